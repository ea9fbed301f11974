"""`generate` on tiny random checkpoints: greedy parity with transformers, eviction, batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import randkv_jax
from randkv_jax import policies
from randkv_jax.decode import decode_chunk, prefill
from randkv_jax.policies import FullAttention, RandomAttention
from tests.hf_tiny import save_tiny

PROMPT_LENGTHS = (5, 17, 11)


def _prompts(lengths=PROMPT_LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in lengths]


def _hf_greedy(hf_model, prompts, max_new_tokens):
    """transformers' greedy generate on a left-padded batch; rows cut after their first EOS."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    eos = hf_model.config.eos_token_id
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=0, eos_token_id=eos)
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@pytest.fixture(scope="module", params=["qwen3_untied", "phi3_longrope"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny(request.param, directory, seed=3)
    return hf_model, randkv_jax.load_model(directory, dtype="float32")


def test_full_attention_greedy_equals_transformers(tiny):
    hf_model, model = tiny
    prompts = _prompts()
    ours = randkv_jax.generate(model, prompts, policy=FullAttention(), max_new_tokens=64, chat=False)
    assert ours.tokens == _hf_greedy(hf_model, prompts, 64)
    assert max(len(t) for t in ours.tokens) > 16  # the comparison covers real decoding


def test_random_attention_with_room_for_everything_equals_full(tiny):
    _, model = tiny
    prompts = _prompts()
    full = randkv_jax.generate(model, prompts, policy=FullAttention(), max_new_tokens=64, chat=False)
    roomy = randkv_jax.generate(model, prompts, policy=RandomAttention(budget=96, buffer=16),
                                max_new_tokens=64, chat=False)
    assert roomy.tokens == full.tokens
    assert all(s.evictions == 0 for s in roomy.stats)


def test_small_budget_bounds_the_buffer(tiny):
    _, model = tiny
    T, r = 24, 8
    prompts = _prompts()
    out = randkv_jax.generate(model, prompts, policy=RandomAttention(budget=T, buffer=r),
                              max_new_tokens=96, chat=False, return_state=True)
    held = np.asarray(out.state.buffer.slots_held())
    assert out.state.buffer.capacity == 128  # max(P, T) + r = 32 slots needed, one attention block
    for row, (p, s) in enumerate(zip(prompts, out.stats)):
        assert s.peak_slots <= max(len(p), T) + r
        assert (held[:, row] <= max(len(p), T) + r).all()
        if s.new_tokens == 96:
            assert s.evictions > 0 and s.held_after_round == T
            assert s.kv_bytes < s.kv_bytes_full
        positions = np.asarray(out.state.buffer.positions)[:, row]
        pinned = set(range(min(len(p), T - r - 1)))
        assert all(pinned <= set(positions[l, h].tolist())
                   for l in range(positions.shape[0]) for h in range(positions.shape[1]))


def test_rows_do_not_depend_on_the_batch(tiny):
    _, model = tiny
    prompts = _prompts((9, 14, 6, 20), seed=4)
    seeds = [101, 102, 103, 104]
    policy = RandomAttention(budget=20, buffer=8)
    for temperature in (0.0, 1.0):
        kw = dict(policy=policy, max_new_tokens=60, chat=False, temperature=temperature,
                  ignore_eos=True, return_state=True)  # both runs take the same number of steps
        batch = randkv_jax.generate(model, prompts, seed=seeds, **kw)
        alone = randkv_jax.generate(model, prompts[2:3], seed=seeds[2:3], **kw)
        assert batch.tokens[2] == alone.tokens[0]
        pos_batch = np.asarray(batch.state.buffer.positions)[:, 2]
        pos_alone = np.asarray(alone.state.buffer.positions)[:, 0]
        n = min(pos_batch.shape[-1], pos_alone.shape[-1])
        np.testing.assert_array_equal(pos_batch[..., :n], pos_alone[..., :n])


def test_same_seed_reruns_identically_and_sampling_uses_the_seed(tiny):
    _, model = tiny
    prompts = _prompts()
    kw = dict(policy=RandomAttention(budget=20, buffer=8), max_new_tokens=48, chat=False, temperature=1.0, top_p=0.9)
    a = randkv_jax.generate(model, prompts, seed=[1, 2, 3], **kw)
    b = randkv_jax.generate(model, prompts, seed=[1, 2, 3], **kw)
    c = randkv_jax.generate(model, prompts, seed=[4, 5, 6], **kw)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_second_call_with_the_same_shapes_does_not_compile(tiny):
    _, model = tiny
    kw = dict(policy=RandomAttention(budget=20, buffer=8), max_new_tokens=40, chat=False)
    randkv_jax.generate(model, _prompts(seed=1), **kw)
    sizes = prefill._cache_size(), decode_chunk._cache_size()
    randkv_jax.generate(model, _prompts(seed=2), **kw)  # other tokens, same lengths bucket
    assert (prefill._cache_size(), decode_chunk._cache_size()) == sizes


def test_capacity_sets_the_buffer_size(tiny):
    _, model = tiny
    kw = dict(policy=RandomAttention(budget=20, buffer=8), max_new_tokens=30, chat=False, return_state=True)
    exact = randkv_jax.generate(model, _prompts(), capacity=64, **kw)  # one compilation for any prompts <= 64
    default = randkv_jax.generate(model, _prompts(), **kw)
    assert exact.state.buffer.capacity == 64 and default.state.buffer.capacity == 128
    assert exact.tokens == default.tokens


def test_bad_input(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="non-empty list"):
        randkv_jax.generate(model, [], chat=False)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        randkv_jax.generate(model, _prompts(), policy="nope", chat=False)
    with pytest.raises(ValueError, match=r"capacity 40 is too small: the longest prompt \(17 tokens, padded to 64\)"):
        randkv_jax.generate(model, _prompts(), policy=FullAttention(), capacity=40, max_new_tokens=8, chat=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        randkv_jax.generate(model, ["a string prompt"])
    with pytest.raises(ValueError, match="budget must be a positive"):
        policies.get("random", budget=0)
    with pytest.raises(ValueError, match="window must be a positive"):
        RandomAttention(buffer=-1)
