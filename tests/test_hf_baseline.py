"""`randkv_jax.eval.hf_baseline`: our parameters back into transformers, and its timed generate."""

from __future__ import annotations

import dataclasses
import os
import types

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from randkv_jax.eval import hf_baseline
from randkv_jax.eval.hf_baseline import (
    HFRun,
    hf_decode_tokens_per_second,
    hf_generate,
    set_threads,
    to_transformers,
)
from randkv_jax.models.loading import load_model

from randkv_jax.generate import generate
from randkv_jax.policies import FullAttention
from tests.hf_tiny import TINY, save_tiny

GENERATE = ("llama", "qwen3_untied", "phi3_longrope")  # one per architecture
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(name) -> (the original HF model, our float32 model loaded from its checkpoint), cached."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            hf_model = save_tiny(name, directory)
            built[name] = hf_model, load_model(directory, dtype="float32")
        return built[name]

    return get


def _prompts(vocab: int, n: int = 2, length: int = 12) -> list[list[int]]:
    return np.random.default_rng(7).integers(3, vocab, size=(n, length)).tolist()


@pytest.mark.parametrize("name", sorted(TINY))
def test_state_dict_round_trips_exactly(tiny, name):
    reference, model = tiny(name)
    hf = to_transformers(model)
    ours, theirs = hf.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys(), name
    for key, value in theirs.items():
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], value), f"{name}: {key}"
    assert type(hf) is type(reference) and not hf.training
    assert hf.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", GENERATE)
def test_greedy_tokens_match_ours(tiny, name, cache):
    _, model = tiny(name)
    prompts = _prompts(model.config.vocab_size)
    ours = generate(model, prompts, policy=FullAttention(), max_new_tokens=NEW_TOKENS, ignore_eos=True, chat=False)
    # Make the first token ours generates transformers' EOS: generation must run on past it.
    eos_first = dataclasses.replace(model.config, eos_token_ids=(ours.tokens[0][0],))
    hf = to_transformers(dataclasses.replace(model, config=eos_first))
    run = hf_generate(hf, prompts, NEW_TOKENS, cache=cache)
    assert isinstance(run, HFRun) and run.seconds > 0
    assert run.tokens == ours.tokens, f"{name} cache={cache}"


def test_decode_rate_counts_the_decode_steps_only(tiny, monkeypatch):
    """A fake clock advanced by the model's forward: 100 s per prefill, 1 s per decode step. The
    rate must be batch * (N - 1) steps / (N - 1) s exactly, whatever the prefill costs."""
    _, model = tiny("llama")
    hf = to_transformers(model)
    clock = [0.0]

    def tick(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        clock[0] += 100.0 if ids.shape[1] > 1 else 1.0

    monkeypatch.setattr(hf_baseline, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    handle = hf.register_forward_pre_hook(tick, with_kwargs=True)
    try:
        prompts = _prompts(model.config.vocab_size)
        run = hf_generate(hf, prompts, 5, cache="dynamic")
        rate, tokens = hf_decode_tokens_per_second(hf, prompts, 5, cache="static", repeats=2)
    finally:
        handle.remove()
    assert run.token_times == (100.0, 101.0, 102.0, 103.0, 104.0) and run.decode_seconds == 4.0
    assert rate == 2.0  # 2 rows x 4 decode steps in 4 s
    assert tokens == run.tokens and all(len(row) == 5 for row in tokens)


def test_static_cache_len_sizes_the_cache(tiny):
    _, model = tiny("qwen3_untied")
    hf = to_transformers(model)
    prompts = _prompts(model.config.vocab_size)
    seen = []
    handle = hf.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["cache"].get_mask_sizes(1, 0)[0]), with_kwargs=True)
    try:
        sized = hf_generate(hf, prompts, 4, cache="static", cache_len=40)
    finally:
        handle.remove()
    assert set(seen) == {40}  # prefill and every decode step ran on the 40-slot cache
    assert sized.tokens == hf_generate(hf, prompts, 4, cache="static").tokens
    with pytest.raises(ValueError, match="cache_len 15 < prompt 12"):
        hf_generate(hf, prompts, 4, cache="static", cache_len=15)
    with pytest.raises(ValueError, match="sizes a static cache"):
        hf_generate(hf, prompts, 4, cache="dynamic", cache_len=40)


def test_set_threads_sets_torchs_intra_op_threads():
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_threads() == (os.cpu_count() or 1) == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_unconsumed_and_missing_parameters_raise(tiny):
    _, model = tiny("qwen3_untied")
    extra = dict(model.params, stray=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="stray not consumed"):
        to_transformers(dataclasses.replace(model, params=extra))
    missing = {k: v for k, v in model.params.items() if k != "final_norm"}
    with pytest.raises(ValueError, match="final_norm/scale is missing: transformers' model.norm.weight"):
        to_transformers(dataclasses.replace(model, params=missing))


def test_generate_refuses_bad_batches(tiny):
    reference, _ = tiny("llama")
    with pytest.raises(ValueError, match="one length"):
        hf_generate(reference, [[5, 6, 7], [5, 6]], 2, cache="dynamic")
    with pytest.raises(ValueError, match="cache must be one of"):
        hf_generate(reference, [[5, 6, 7]], 2, cache="offloaded")
