"""The Pallas eviction kernel (`kernels/random_keep.py`): bit-exact against the jnp/XLA paths in
interpret mode, cross-lowered for TPU (Mosaic) and GPU (Triton) at real model shapes, statistics
of its keep-sets, and `generate` with backend="pallas" equal to backend="xla".

CPU only: the kernel runs in interpret mode, and the lowering tests stop at JAX's Python-side
lowering (the Mosaic and Triton compilers themselves need a device).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

import randkv_jax
from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.random_keep import PLATFORMS, random_keep_mask, random_keep_mask_reference
from randkv_jax.policies import RandomAttention
from tests.hf_tiny import save_tiny

# a small pool of compiled cases (compiling one costs ~2-4 s here); hypothesis draws the data.
# shape = (layers, batch, KV heads, slots): 10 KV heads as Phi-4, slot counts not powers of two.
# policy: the budget convention of a RandomAttention(backend="pallas" vs "xla") check, None: no check
CASES = [  # shape, r, sinks, shared_across_heads, block_size, platform, policy
    ((2, 3, 10, 45), 8, None, False, 1, "tpu", "text"),
    ((2, 3, 10, 45), 8, 3, False, 4, "triton", None),
    ((1, 2, 4, 64), 2, 0, True, 3, "tpu", "vllm"),
    ((3, 2, 2, 33), 8, None, True, 1, "triton", "vllm"),
]
SINKS = {None: "prompt", 0: "none", 3: "sinks:3"}


def _state(rng, shape, buffer):
    """Random buffer contents: per head a sorted subset of the history, holes, a full-prompt row."""
    l, b, k, s = shape
    prompt = rng.integers(0, s + 1, size=b)
    prompt[rng.integers(b)] = s  # one row's prompt fills the whole buffer
    n_gen = int(rng.integers(0, 3 * s)) if rng.random() < 0.5 else buffer * int(rng.integers(1, 3 * s // buffer + 2))
    pos = np.full(shape, -1, np.int32)
    for bi in range(b):
        total = int(prompt[bi]) + n_gen
        for li in range(l):
            for h in range(k):
                if prompt[bi] == s:
                    held = np.arange(s)
                else:
                    held = np.sort(rng.choice(total, size=int(rng.integers(0, min(s, total) + 1)), replace=False))
                pos[li, bi, h, : len(held)] = held
                if rng.random() < 0.2:  # holes anywhere
                    pos[li, bi, h, rng.integers(0, s, size=3)] = -1
    kept = rng.integers(0, s + 3, size=b)  # includes K >= eligible
    kept[rng.integers(b)] = 0
    seeds = rng.integers(-(2**31), 2**31, size=b)
    return (jnp.asarray(pos), jnp.asarray(prompt, jnp.int32), jnp.asarray(kept, jnp.int32),
            jnp.asarray(seeds, jnp.int32), int(rng.integers(-(2**31), 2**32)), jnp.int32(n_gen))


@functools.partial(jax.jit, static_argnums=0)
def _keep_mask(policy, buf, n_generated, row_seeds):
    return policy.keep_mask(buf, n_generated, row_seeds)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data_seed=st.integers(0, 2**32 - 1))
def test_kernel_equals_reference_bit_for_bit(case, data_seed):
    shape, buffer, sinks, shared, block_size, platform, convention = case
    case_index = CASES.index(case)
    rng = np.random.default_rng(data_seed)
    static = dict(buffer=buffer, sinks=sinks, shared_across_heads=shared, block_size=block_size)
    for _ in range(2):  # two buffers per compiled kernel
        args = _state(rng, shape, buffer)
        ref = np.asarray(random_keep_mask_reference(*args, **static))
        out = np.asarray(random_keep_mask(*args, **static, platform=platform))
        np.testing.assert_array_equal(out, ref)
        for method in ("top_k", "bisect") if case_index < 2 else ():  # compiles cost: two cases
            np.testing.assert_array_equal(np.asarray(random_keep_mask_reference(*args, **static, method=method)), ref)
        # every row keeps protected + min(K, eligible) per head, never an empty slot
        pos = np.asarray(args[0])
        assert not (out & (pos < 0)).any()

    # the policy: backend="pallas" equals backend="xla" (`due` handling and per-row K included);
    # (three cases only: each costs two more compilations)
    if convention is None:
        return
    pos, prompt, kept, seeds, seed, n_gen = args
    l, b, k, s = shape
    zeros = jnp.zeros((l, b, k, s, 1), jnp.float32)
    buf = KVBuffer(zeros, zeros, pos, prompt, jnp.sum(pos[0, :, 0] >= 0, axis=-1).astype(jnp.int32))
    policy = RandomAttention(budget=s // 3 + buffer + 1, buffer=buffer, protect=SINKS[sinks],
                             convention=convention, seed=case_index, shared_across_heads=shared,
                             block_size=block_size)
    xla = _keep_mask(policy, buf, n_gen, seeds)
    pallas = _keep_mask(dataclasses.replace(policy, backend="pallas"), buf, n_gen, seeds)
    np.testing.assert_array_equal(np.asarray(pallas), np.asarray(xla))


def test_keep_counts_protected_and_window():
    """Hand-built case: exact counts, protected slots in, empty slots out, ties to the lower slot."""
    l, b, k, s, r = 2, 2, 3, 40, 4
    pos = np.full((l, b, k, s), -1, np.int32)
    pos[:, 0, :, :30] = np.arange(30)  # prompt 5, generated 25 -> eligible 5 .. 25 (21), window 26 .. 29
    pos[:, 1, :, :12] = np.arange(12)  # prompt 10: eligible 10 .. 11 (2) < K
    args = (jnp.asarray(pos), jnp.asarray([5, 10], jnp.int32), jnp.asarray([7, 7], jnp.int32),
            jnp.asarray([1, 2], jnp.int32), 0)
    keep = np.asarray(random_keep_mask(*args, jnp.int32(25), buffer=r))  # both layouts: the property test
    np.testing.assert_array_equal(keep.sum(-1)[:, 0], 5 + 7 + 4)
    np.testing.assert_array_equal(keep.sum(-1)[:, 1], 12)
    assert keep[:, 0, :, :5].all() and keep[:, 0, :, 26:30].all() and not keep[..., 30:].any()
    # block_size 8: whole blocks tie; K = 7 takes 7 of the K-th block's 8 slots, the lowest ones
    blocks = np.asarray(random_keep_mask(*args, jnp.int32(25), buffer=r, block_size=8))[:, 0, :, 5:26]
    np.testing.assert_array_equal(blocks.sum(-1), 7)
    for kept in blocks.reshape(-1, 21):
        slots = np.flatnonzero(kept) + 5
        block_of = slots // 8
        sizes = {q: len(range(max(8 * q, 5), min(8 * q + 8, 26))) for q in set(block_of.tolist())}
        partial = [q for q in sizes if (block_of == q).sum() < sizes[q]]
        assert len(partial) <= 1  # blocks are taken whole but for the one that completes K
        for q in partial:  # ... which gives its lowest slots
            got = slots[block_of == q]
            np.testing.assert_array_equal(got, np.arange(max(8 * q, 5), max(8 * q, 5) + len(got)))


# --- cross-lowering (no device needed): Qwen3-4B, Qwen3-32B, Phi-4-reasoning at K=2048, r=64, batch 8
MODELS = {"Qwen3-4B": (36, 8), "Qwen3-32B": (64, 8), "Phi-4-reasoning": (40, 10)}
K, R, BATCH = 2048, 64, 8
CAPACITIES = [1024 + K + 2 * R, 1100 + K + 2 * R, 3328]  # prompt 1024 -> 3200; 1100 -> 3276; rounded up to 128


def _lower(platform, layers, kv_heads, capacity, **static):
    target = {"tpu": "tpu", "triton": "cuda"}[platform]

    def round_(positions, prompt_lens, kept, row_seeds, seed, n_generated):
        return random_keep_mask(positions, prompt_lens, kept, row_seeds, seed, n_generated, buffer=R,
                                platform=platform, interpret=False, **static)

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    lowered = jax.jit(round_).trace(
        i32(layers, BATCH, kv_heads, capacity), i32(BATCH), i32(BATCH), i32(BATCH), i32(), i32()
    ).lower(lowering_platforms=(target,))
    return lowered.as_text()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_cross_lowers_for_tpu_and_triton(platform, model, capacity):
    text = _lower(platform, *MODELS[model], capacity)
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("static", [
    dict(shared_across_heads=True), dict(block_size=16), dict(block_size=3, sinks=4), dict(sinks=0),
])
def test_cross_lowers_policy_variants(platform, static):
    _lower(platform, *MODELS["Phi-4-reasoning"], CAPACITIES[0], **static)


def test_backend_field():
    assert RandomAttention().backend == "auto"
    assert RandomAttention().resolved_backend() == ("xla" if jax.default_backend() == "cpu" else "pallas")
    assert RandomAttention(backend="pallas").resolved_backend() == "pallas"
    with pytest.raises(ValueError, match="backend must be one of"):
        RandomAttention(backend="triton")
    with pytest.raises(ValueError, match="platform must be one of"):
        random_keep_mask(jnp.zeros((1, 1, 1, 4), jnp.int32), *[jnp.zeros((1,), jnp.int32)] * 3, 0, 0,
                         buffer=2, platform="mosaic_gpu")


# --- statistics of the kernel's keep-sets
P, N, KS, L, B, H = 4, 48, 16, 4, 8, 8  # prompt, eligible candidates, K, layers, rows, heads
S = P + N + 8


def _stat_rounds(n_calls, rounds, **static):
    """keep [calls, rounds, L, B, H, N] over the N candidates (no window entries), fresh row seeds."""
    pos = np.full((L, B, H, S), -1, np.int32)
    pos[..., : P + N] = np.arange(P + N)
    args = (jnp.asarray(pos), jnp.full((B,), P, jnp.int32), jnp.full((B,), KS, jnp.int32))
    out = []
    for call in range(n_calls):
        seeds = jnp.arange(B, dtype=jnp.int32) + B * call
        # n_generated r * (m + 8): window starts past every held position, so only the round changes
        out.append([np.asarray(random_keep_mask(*args, seeds, 7, jnp.int32(8 * (8 + m)), buffer=8, **static))
                    [..., P : P + N] for m in range(rounds)])
    return np.asarray(out)


@pytest.fixture(scope="module")
def keeps():
    return _stat_rounds(6, 2)  # 6 x 2 x 4 x 8 x 8 = 3072 keep-sets


def test_every_head_keeps_exactly_k(keeps):
    assert (keeps.sum(-1) == KS).all()


def test_inclusion_probability_is_k_over_n(keeps):
    counts = keeps.reshape(-1, N).sum(0)
    trials = keeps.reshape(-1, N).shape[0]
    p = KS / N
    expected = trials * p
    # per-slot counts are binomial(trials, K/N) with a fixed total: chi-square on N-1 dof
    chi2 = ((counts - expected) ** 2 / (expected * (1 - p))).sum()
    assert stats.chi2.sf(chi2, N - 1) > 1e-3, (chi2, counts)


def _overlap_matches_hypergeometric(a, b):
    overlap = (a & b).sum(-1).ravel()
    dist = stats.hypergeom(N, KS, KS)
    values = np.arange(KS + 1)
    expected = dist.pmf(values) * len(overlap)
    observed = np.bincount(overlap, minlength=KS + 1)
    # pool tails with expected < 5 into the neighbouring bins
    keep = expected >= 5
    lo, hi = values[keep].min(), values[keep].max()
    obs = np.concatenate([[observed[: lo + 1].sum()], observed[lo + 1 : hi], [observed[hi:].sum()]])
    exp = np.concatenate([[expected[: lo + 1].sum()], expected[lo + 1 : hi], [expected[hi:].sum()]])
    exp *= obs.sum() / exp.sum()
    chi2 = ((obs - exp) ** 2 / exp).sum()
    assert stats.chi2.sf(chi2, len(obs) - 1) > 1e-3, (obs, exp)
    # and the keep indicators are uncorrelated
    corr = np.corrcoef(a.reshape(-1).astype(float), b.reshape(-1).astype(float))[0, 1]
    assert abs(corr) < 4 / np.sqrt(a.size), corr


def test_independent_across_heads_layers_rounds_and_rows(keeps):
    _overlap_matches_hypergeometric(keeps[:, :, :, :, :-1], keeps[:, :, :, :, 1:])  # heads
    _overlap_matches_hypergeometric(keeps[:, :, :-1], keeps[:, :, 1:])  # layers
    _overlap_matches_hypergeometric(keeps[:, 0], keeps[:, 1])  # rounds
    _overlap_matches_hypergeometric(keeps[:, :, :, :-1], keeps[:, :, :, 1:])  # rows (row seeds)


def test_shared_across_heads_shares_and_blocks_come_whole():
    shared = _stat_rounds(1, 1, shared_across_heads=True)[0, 0]
    assert (shared == shared[:, :, :1]).all()  # every head keeps the same set
    shared = _stat_rounds(4, 1, shared_across_heads=True)[:, 0, :, :, 0]  # [calls, L, B, N]: head 0
    _overlap_matches_hypergeometric(shared[:, :-1], shared[:, 1:])  # layers still independent
    blocks = _stat_rounds(1, 1, block_size=4)[0, 0]  # candidates 4 .. 51 = 12 whole blocks of 4
    per_block = blocks.reshape(L, B, H, N // 4, 4).sum(-1)
    assert set(np.unique(per_block).tolist()) <= {0, 4}


# --- end to end: generate() with the kernel in the decode loop
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_untied")
    save_tiny("qwen3_untied", directory, seed=3)
    return randkv_jax.load_model(directory, dtype="float32")


def test_generate_pallas_equals_xla(tiny_model):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 11)]
    policy = RandomAttention(budget=16, buffer=8, seed=3)
    runs = {}
    for backend in ("xla", "pallas"):
        runs[backend] = randkv_jax.generate(
            tiny_model, prompts, policy=dataclasses.replace(policy, backend=backend), max_new_tokens=80,
            chat=False, ignore_eos=True, return_state=True, seed=[4, 5, 6], temperature=1.0,
        )
    xla, pallas = runs["xla"], runs["pallas"]
    assert all(s.evictions >= 5 for s in pallas.stats)
    assert pallas.tokens == xla.tokens
    np.testing.assert_array_equal(np.asarray(pallas.state.buffer.positions), np.asarray(xla.state.buffer.positions))
    np.testing.assert_array_equal(np.asarray(pallas.state.buffer.keys), np.asarray(xla.state.buffer.keys))
