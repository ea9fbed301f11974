"""randkv_jax.models.tokenizer against transformers (Qwen3 tokenizer files and the Phi-4-reasoning chat template)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path

import jinja2
import numpy as np
import pytest
import tokenizers

from randkv_jax.models.tokenizer import ChatTemplateError, Tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
QWEN3_DIR = SHARED / "tokenizers" / "qwen3"
PHI4_TEMPLATE = SHARED / "tokenizers" / "phi-4-reasoning" / "chat_template.jinja"

THINK_REPLY = "<think>\nThe user greets me. Reply politely.\n</think>\n\nHello! How can I help?"
CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2 + 2?"}],
    "system": [
        {"role": "system", "content": "You are a careful mathematician."},
        {"role": "user", "content": "Prove that sqrt(2) is irrational."},
    ],
    "multi_turn_think": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": THINK_REPLY},
        {"role": "user", "content": "Now compute 17 * 23."},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": THINK_REPLY},
    ],
    "unicode_math": [
        {"role": "user", "content": "Grüße! 计算 ∫₀¹ x² dx = ⅓ ✓ — and 🚀 résumé\n\n\tindented  spaces  "},
    ],
}
TEXTS = [
    "Hello world!",
    "Grüße, 世界! 🚀 ∫₀¹ x² dx = 1/3",
    "  leading spaces\n\n\ttabs and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nreasoning\n</think>",
    "",
]


@pytest.fixture(scope="module")
def qwen3_dir() -> Path:
    if not (QWEN3_DIR / "tokenizer.json").is_file():
        pytest.skip(f"../shared/tokenizers/qwen3 not found: {QWEN3_DIR} (the Qwen3 tokenizer files are needed)")
    return QWEN3_DIR


@pytest.fixture(scope="module")
def ours(qwen3_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(qwen3_dir)


@pytest.fixture(scope="module")
def hf(qwen3_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))


@pytest.fixture(scope="module")
def phi4_template() -> str:
    if not PHI4_TEMPLATE.is_file():
        pytest.skip(f"../shared/tokenizers/phi-4-reasoning/chat_template.jinja not found: {PHI4_TEMPLATE}")
    return PHI4_TEMPLATE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def phi4(ours: Tokenizer, phi4_template: str) -> Tokenizer:
    """The Qwen3 vocabulary with the Phi-4-reasoning template and special tokens, built in memory."""
    return Tokenizer(ours.backend, phi4_template, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})


@pytest.fixture(scope="module")
def tiny() -> tokenizers.Tokenizer:
    """A word-level tokenizer built in memory (fast to save/load), with the Qwen3/Phi-4 special token strings."""
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "<|im_end|>": 2, "hi": 3, "there": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    return backend


def hf_chat_ids(hf, messages, **kw) -> list[int]:
    """transformers 5 returns a BatchEncoding for tokenize=True; older versions a list."""
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    if not isinstance(out, list):
        out = out["input_ids"]
    return list(out)


# --- Qwen3 parity with transformers ---------------------------------------------------------------------
def test_qwen3_special_tokens(ours: Tokenizer, hf) -> None:
    assert ours.eos_token_ids == [hf.eos_token_id] == [151645]
    assert ours.pad_token_id == hf.pad_token_id == 151643
    assert ours.bos_token_id is None and hf.bos_token_id is None
    assert ours.vocab_size == len(hf) == 151669
    assert ours.token_to_id("<think>") == 151667 and ours.token_to_id("not-a-token-xyz") is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [None, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_qwen3_chat_template_matches_transformers(ours, hf, name, enable_thinking, add_generation_prompt) -> None:
    messages = CONVERSATIONS[name]
    kw = {"add_generation_prompt": add_generation_prompt}
    if enable_thinking is not None:
        kw["enable_thinking"] = enable_thinking
    text = ours.apply_chat_template(messages, tokenize=False, **kw)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kw)
    ids = ours.apply_chat_template(messages, **kw)
    assert ids == hf_chat_ids(hf, messages, **kw)
    assert ours.decode(ids, skip_special_tokens=False) == text
    if add_generation_prompt:
        suffix = "<think>\n\n</think>\n\n" if enable_thinking is False else ""
        assert text.endswith("<|im_start|>assistant\n" + suffix)


def test_qwen3_tools_and_reasoning_content(ours, hf) -> None:
    """`tools` goes through the tojson filter; `reasoning_content` messages are rendered like transformers."""
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    function = {"name": "wetter", "description": "Wetter für eine Stadt (°C)", "parameters": parameters}
    tools = [{"type": "function", "function": function}]
    messages = [
        {"role": "user", "content": "Wie ist das Wetter in Zürich?"},
        {"role": "assistant", "content": "Sonnig.", "reasoning_content": "Look it up.", "tool_calls": None},
        {"role": "user", "content": "Danke"},
    ]
    text = ours.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"Wetter für eine Stadt (°C)"' in text  # ensure_ascii=False


@pytest.mark.parametrize("text", TEXTS)
def test_qwen3_encode_decode_matches_transformers(ours, hf, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf.encode(text) == ours.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_batch_decode_accepts_arrays(ours, hf) -> None:
    rows = [ours.encode(t) for t in TEXTS[:2]]
    assert ours.batch_decode(rows) == hf.batch_decode(rows, skip_special_tokens=True)
    padded = np.full((2, max(map(len, rows))), ours.pad_token_id, np.int32)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    assert ours.batch_decode(padded) == [ours.decode(r) for r in rows]
    assert ours.decode(np.asarray(rows[0], np.int32)) == TEXTS[0]


def test_chat_prompt(ours: Tokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert ours.chat_prompt("U", system="S") == ours.apply_chat_template(messages)
    assert ours.chat_prompt("U", tokenize=False, enable_thinking=False) == ours.apply_chat_template(
        messages[1:], tokenize=False, enable_thinking=False
    )


# --- Phi-4-reasoning template ---------------------------------------------------------------------------
def test_phi4_reasoning_template(phi4: Tokenizer, phi4_template: str, hf) -> None:
    messages = [{"role": "user", "content": "What is 3 * 7?"}]
    text = phi4.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system<|im_sep|>You are Phi, a language model trained by Microsoft")
    assert "Now, try to solve the following question through the above guidelines:<|im_end|>" in text
    assert "<|im_start|>user<|im_sep|>What is 3 * 7?<|im_end|>" in text
    assert text.endswith("<|im_end|><|im_start|>assistant<|im_sep|>")
    assert text == hf.apply_chat_template(messages, chat_template=phi4_template, tokenize=False,
                                          add_generation_prompt=True)
    assert phi4.eos_token_ids == [151645] and phi4.bos_token_id == 151643

    # An assistant turn goes through the {% generation %} block, which must render its body.
    turns = [*messages, {"role": "assistant", "content": "<think>3*7=21</think>21"}, {"role": "user", "content": "x2?"}]
    text = phi4.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
    assert ("<|im_start|>assistant<|im_sep|><think>3*7=21</think>21<|im_end|>"
            "<|im_start|>user<|im_sep|>x2?<|im_end|>") in text
    assert text == hf.apply_chat_template(turns, chat_template=phi4_template, tokenize=False,
                                          add_generation_prompt=False)


# --- save / from_dir ------------------------------------------------------------------------------------
def test_save_round_trip(ours: Tokenizer, tiny, phi4_template: str, tmp_path: Path) -> None:
    phi4_tiny = Tokenizer(tiny, phi4_template, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    for name, tok in (("qwen3", ours), ("phi4", phi4_tiny)):
        tok.save(tmp_path / name)
        back = Tokenizer.from_dir(tmp_path / name)
        assert back.backend.to_str() == tok.backend.to_str()
        assert back.chat_template == tok.chat_template
        assert back.special_tokens == tok.special_tokens
        assert (back.eos_token_ids, back.bos_token_id, back.pad_token_id) == (
            tok.eos_token_ids, tok.bos_token_id, tok.pad_token_id)
        for text in TEXTS:
            assert back.encode(text) == tok.encode(text)
        for messages in CONVERSATIONS.values():
            text = tok.apply_chat_template(messages, tokenize=False)
            assert back.apply_chat_template(messages, tokenize=False) == text
            assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_saved_dir_loads_in_transformers(tiny, phi4_template: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    phi4_tiny = Tokenizer(tiny, phi4_template, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    phi4_tiny.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = CONVERSATIONS["system"]
    text = phi4_tiny.apply_chat_template(messages, tokenize=False)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert hf.eos_token == "<|im_end|>" and hf.bos_token == "<|endoftext|>"
    assert hf.encode("hi there <|im_end|>") == phi4_tiny.encode("hi there <|im_end|>") == [3, 4, 2]


def test_chat_template_file_and_eos_forms(tiny, tmp_path: Path) -> None:
    """chat_template.jinja is read (and wins over the config's template, as in transformers); AddedToken dicts."""
    Tokenizer(tiny, "config template", {"eos_token": "<|im_end|>"}).save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).chat_template is None
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}|{{ eos_token }}|{{ messages[0]['content'] }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == [2]
    assert tok.chat_prompt("hi", tokenize=False) == "|<|im_end|>|hi"  # no bos_token: undefined renders ""
    assert tok.chat_prompt("hi") == [0, 2, 0, 3]  # "|" is <unk> in the tiny vocabulary
    config["chat_template"] = "config template"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).chat_prompt("hi", tokenize=False) == "|<|im_end|>|hi"

    two = Tokenizer(tiny, None, {"eos_token": ["<|im_end|>", "<|endoftext|>"]})
    assert two.eos_token_ids == [2, 1] and two.special_tokens["eos_token"] == "<|im_end|>"
    two.save(tmp_path / "two")
    assert Tokenizer.from_dir(tmp_path / "two").eos_token_ids == [2, 1]


# --- errors ---------------------------------------------------------------------------------------------
def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found in"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse .*tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_template_errors(ours: Tokenizer) -> None:
    bad = Tokenizer(ours.backend, "{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    with pytest.raises(ValueError, match="Conversation roles must alternate user/assistant") as info:
        bad.chat_prompt("hi")
    assert isinstance(info.value, ChatTemplateError)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(ours.backend).chat_prompt("hi")
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        Tokenizer(ours.backend, None, {"eos_token": "<|no_such_token|>"})
    with pytest.raises(ValueError, match="unknown special token"):
        Tokenizer(ours.backend, None, {"eot_token": "<|im_end|>"})


def test_template_helpers(ours: Tokenizer) -> None:
    """tojson is json.dumps(ensure_ascii=False) with indent; strftime_now and the sandbox work."""
    template = "{{ messages[0] | tojson }}\n{{ messages[0] | tojson(indent=2) }}\n{{ strftime_now('%Y') }}"
    tok = Tokenizer(ours.backend, template)
    message = {"role": "user", "content": "<b>é 世界</b>"}
    text = tok.chat_prompt("<b>é 世界</b>", tokenize=False)
    lines = text.split("\n", 1)
    assert lines[0] == json.dumps(message, ensure_ascii=False)
    assert lines[1].startswith(json.dumps(message, ensure_ascii=False, indent=2))
    assert text.rstrip()[-4:].isdigit()
    assert Tokenizer(ours.backend, "{{ messages.__class__ }}").chat_prompt("hi", tokenize=False) == ""  # sandboxed
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable sandbox
        Tokenizer(ours.backend, "{{ messages.append(1) }}").chat_prompt("hi", tokenize=False)
