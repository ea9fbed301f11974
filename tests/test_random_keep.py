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
from randkv_jax.decode import padded_capacity
from randkv_jax.kernels.random_keep import PLATFORMS, random_keep_mask, random_keep_mask_reference
from randkv_jax.policies import RandomAttention
from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.rule import EvictionRule, parse_protect

# a small pool of compiled cases (compiling one costs ~2-4 s here); hypothesis draws the data.
# shape = (layers, batch, KV heads, slots): 10 KV heads as Phi-4, slot counts not powers of two.
# rule = EvictionRule(budget T, window w, interval i, protect); policy: also check
# RandomAttention(backend="pallas") against backend="xla" on a buffer with due and not-due rows
CASES = [  # shape, rule, shared_across_heads, slots_per_draw, platform, policy
    ((2, 3, 10, 45), EvictionRule(20, 8, 8, "prompt"), False, 1, "tpu", True),
    ((2, 3, 10, 45), EvictionRule(16, 4, 8, "sinks:3"), False, 4, "triton", False),
    ((1, 2, 4, 64), EvictionRule(10, 2, 2, "none"), True, 3, "tpu", True),
    ((3, 2, 2, 33), EvictionRule(16, 8, 4, "prompt"), True, 1, "triton", True),
]


def _case_id(case):
    shape, rule, shared, spd, platform, policy = case
    return (f"{'x'.join(map(str, shape))}-T{rule.budget}w{rule.window}i{rule.interval}-{rule.protect}-"
            f"{'shared' if shared else 'perhead'}-spd{spd}-{platform}{'-policy' if policy else ''}")


def _np_masks(rule, pos, prompt, generated):
    """Pinned, window and eligible slots in NumPy, from the rule's definition (not its code)."""
    sinks = parse_protect(rule.protect)
    cap = rule.selected - 1 if sinks is None else min(sinks, rule.selected - 1)
    row = lambda x: np.asarray(x)[None, :, None, None]  # noqa: E731
    valid = pos >= 0
    pinned = valid & (pos < np.minimum(row(prompt), cap))
    window = valid & (pos >= row(prompt) + row(generated) - rule.window)
    return pinned, window, valid & ~pinned & ~window


def _state(rng, shape, rule):
    """Random kernel inputs: per head a sorted subset of the history, holes, a full-prompt row,
    per-row generated counts (some multiples of the interval) and per-row n_select."""
    l, b, k, s = shape
    prompt = rng.integers(0, s + 1, size=b)
    prompt[rng.integers(b)] = s  # one row's prompt fills the whole buffer
    generated = np.where(rng.random(b) < 0.5, rng.integers(0, 3 * s, size=b),
                         rule.interval * rng.integers(1, 3 * s // rule.interval + 2, size=b))
    pos = np.full(shape, -1, np.int32)
    for bi in range(b):
        total = int(prompt[bi] + generated[bi])
        for li in range(l):
            for h in range(k):
                if prompt[bi] == s:
                    held = np.arange(s)
                else:
                    held = np.sort(rng.choice(total, size=int(rng.integers(0, min(s, total) + 1)), replace=False))
                pos[li, bi, h, : len(held)] = held
                if rng.random() < 0.2:  # holes anywhere
                    pos[li, bi, h, rng.integers(0, s, size=3)] = -1
    n_select = rng.integers(0, s + 3, size=b)  # includes n_select >= eligible (a row not due)
    n_select[rng.integers(b)] = 0
    seeds = rng.integers(-(2**31), 2**31, size=b)
    return (jnp.asarray(pos), jnp.asarray(prompt, jnp.int32), jnp.asarray(generated, jnp.int32),
            jnp.asarray(n_select, jnp.int32), jnp.asarray(seeds, jnp.int32), int(rng.integers(-(2**31), 2**32)))


def _held(rng, n_pinned, total, window, fill):
    """Sorted positions of one head: the pinned prefix, the window and fill - pinned - window of
    the rest of the history [0, total), drawn at random."""
    middle = np.arange(n_pinned, total - window)
    rest = np.sort(rng.choice(middle, size=fill - n_pinned - window, replace=False))
    return np.concatenate([np.arange(n_pinned), rest, np.arange(total - window, total)])


def _policy_state(rng, shape, rule):
    """A buffer as the decode loop leaves it (compacted, every head of a row holding `fill`
    entries) with rows of three kinds, in random order: due with a prompt longer than K_sel (its
    tail competes), due with a short prompt, and not due (generated count off the interval,
    too few entries held, or no token generated yet)."""
    l, b, k, s = shape
    T, w, i, ksel = rule.budget, rule.window, rule.interval, rule.selected
    kinds = ["due_long", "not_due"] + list(rng.choice(["due_short", "not_due", "due_long"], size=b - 2))
    kinds = [kinds[j] for j in rng.permutation(b)]
    pos = np.full(shape, -1, np.int32)
    prompt, generated, fill = np.zeros(b, int), np.zeros(b, int), np.zeros(b, int)
    for bi, kind in enumerate(kinds):
        if kind.startswith("due"):
            P = int(rng.integers(ksel + 1, s - i + 1) if kind == "due_long" else rng.integers(0, ksel))
            first = max(1, -(-(T + 1 - P) // i))  # rounds of i tokens until P + g > T
            g = i * int(rng.integers(first, first + 4))
            f = int(rng.integers(T + 1, min(s, P + g) + 1))
        else:
            P = int(rng.integers(0, s + 1))
            why = int(rng.integers(3)) if i > 1 else int(rng.integers(1, 3))
            if why == 0:  # generated count off the interval
                g = i * int(rng.integers(0, 4 * s // i)) + int(rng.integers(1, i))
                f = int(rng.integers(0, min(s, P + g) + 1))
            elif why == 1:  # prefill only
                g, f = 0, P
            else:  # on the interval, but no more than T held
                g = i * int(rng.integers(1, 4 * s // i))
                f = int(rng.integers(0, min(T, P + g) + 1))
        n_pinned = int(np.asarray(rule.n_pinned(P)))
        prompt[bi], generated[bi], fill[bi] = P, g, f
        for li in range(l):
            for h in range(k):
                if kind.startswith("due"):
                    held = _held(rng, n_pinned, P + g, w, f)
                else:
                    held = np.sort(rng.choice(P + g, size=f, replace=False))
                pos[li, bi, h, :f] = held
    due = (generated > 0) & (generated % i == 0) & (fill > T)
    assert due.any() and not due.all() and (due & (prompt > ksel)).any()
    zeros = jnp.zeros((*shape, 1), jnp.float32)
    buf = KVBuffer(zeros, zeros, jnp.asarray(pos), jnp.asarray(prompt, jnp.int32), jnp.asarray(fill, jnp.int32),
                   jnp.asarray(generated, jnp.int32))
    return buf, due


@functools.partial(jax.jit, static_argnums=0)
def _keep_mask(policy, buf, row_seeds):
    return policy.keep_mask(buf, row_seeds, platform="cpu")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data_seed=st.integers(0, 2**32 - 1))
def test_kernel_equals_reference_bit_for_bit(case, data_seed):
    shape, rule, shared, slots_per_draw, platform, check_policy = case
    case_index = CASES.index(case)
    rng = np.random.default_rng(data_seed)
    static = dict(rule=rule, shared_across_heads=shared, slots_per_draw=slots_per_draw)
    for _ in range(2):  # two buffers per compiled kernel
        args = _state(rng, shape, rule)
        ref = np.asarray(random_keep_mask_reference(*args, **static))
        out = np.asarray(random_keep_mask(*args, **static, platform=platform, interpret=True))
        np.testing.assert_array_equal(out, ref)
        for method in ("top_k", "bisect") if case_index < 2 else ():  # compiles cost: two cases
            np.testing.assert_array_equal(np.asarray(random_keep_mask_reference(*args, **static, method=method)), ref)
        # every head keeps its protected slots + min(n_select, eligible) others, never an empty slot
        pos, prompt, generated, n_select = (np.asarray(a) for a in args[:4])
        pinned, window, eligible = _np_masks(rule, pos, prompt, generated)
        assert not (out & (pos < 0)).any()
        assert out[pinned | window].all()
        expected = (pinned | window).sum(-1) + np.minimum(n_select[None, :, None], eligible.sum(-1))
        np.testing.assert_array_equal(out.sum(-1), expected)

    # the policy: backend="pallas" equals backend="xla" (both bisections; `due` handling and per-row
    # n_select included) and the shared `EvictionPolicy.keep_mask` (select_top's stable argsort of
    # Random's scores); (three cases only: each costs three more compilations)
    if not check_policy:
        return
    buf, due = _policy_state(rng, shape, rule)
    seeds = args[4]
    policy = RandomAttention(budget=rule.budget, window=rule.window, interval=rule.interval, protect=rule.protect,
                             seed=case_index, shared_across_heads=shared, slots_per_draw=slots_per_draw)
    assert policy.rule == rule
    np.testing.assert_array_equal(np.asarray(policy.due(buf)), due)
    xla = np.asarray(_keep_mask(policy, buf, seeds))
    pallas = np.asarray(_keep_mask(dataclasses.replace(policy, backend="pallas"), buf, seeds))
    np.testing.assert_array_equal(pallas, xla)
    shared = jax.jit(functools.partial(EvictionPolicy.keep_mask, policy, platform="cpu"))(buf, seeds)
    np.testing.assert_array_equal(np.asarray(shared), xla)
    # due rows compact to exactly T per head, protected slots in; rows not due keep every valid entry
    pos = np.asarray(buf.positions)
    pinned, window, _ = _np_masks(rule, pos, np.asarray(buf.prompt_lens), np.asarray(buf.generated))
    assert (xla.sum(-1)[:, due] == rule.budget).all()
    assert xla[:, due][(pinned | window)[:, due]].all()
    np.testing.assert_array_equal(xla[:, ~due], pos[:, ~due] >= 0)


def test_keep_counts_protected_and_window():
    """Hand-built case: exact counts, protected slots in, empty slots out, ties to the lower slot."""
    l, b, k, s = 2, 3, 3, 40
    rule = EvictionRule(budget=16, window=4, interval=5)  # K_sel = 12
    pos = np.full((l, b, k, s), -1, np.int32)
    pos[:, 0, :, :30] = np.arange(30)  # prompt 5, generated 25: pinned 0..4, eligible 5..25 (21), window 26..29
    pos[:, 1, :, :30] = np.arange(30)  # prompt 20 > K_sel, generated 10: pinned 0..10, eligible 11..25 (15)
    pos[:, 2, :, :12] = np.arange(12)  # prompt 10, generated 2: not due
    prompt, generated = jnp.asarray([5, 20, 10], jnp.int32), jnp.asarray([25, 10, 2], jnp.int32)
    fill = jnp.asarray([30, 30, 12], jnp.int32)
    due = rule.due(fill, generated)
    np.testing.assert_array_equal(np.asarray(due), [True, True, False])
    np.testing.assert_array_equal(np.asarray(rule.n_pinned(prompt)), [5, 11, 10])
    n_select = jnp.where(due, rule.n_select(prompt), s)  # as RandomAttention passes it
    np.testing.assert_array_equal(np.asarray(n_select), [7, 1, s])
    args = (jnp.asarray(pos), prompt, generated, n_select, jnp.asarray([1, 2, 3], jnp.int32), 0)
    for platform in PLATFORMS:  # both layouts (the property test covers them at random)
        keep = np.asarray(random_keep_mask(*args, rule=rule, platform=platform, interpret=True))
        # due rows: window 4 + min(P, K_sel - 1) pinned + (K_sel - pinned) selected = T = 16
        np.testing.assert_array_equal(keep.sum(-1)[:, :2], rule.budget)
        np.testing.assert_array_equal(keep[:, 0, :, 5:26].sum(-1), 7)
        np.testing.assert_array_equal(keep[:, 1, :, 11:26].sum(-1), 1)  # the prompt's tail 11..19 competes
        assert keep[:, 0, :, :5].all() and keep[:, 1, :, :11].all() and keep[:, :2, :, 26:30].all()
        np.testing.assert_array_equal(keep[:, 2], pos[:, 2] >= 0)  # not due: every valid entry
        assert not keep[..., 30:].any()
    # slots_per_draw 8: whole blocks tie; 7 selected takes 7 of the last block's 8 slots, the lowest ones
    blocks = np.asarray(random_keep_mask(*args, rule=rule, platform="tpu", interpret=True,
                                         slots_per_draw=8))[:, 0, :, 5:26]
    np.testing.assert_array_equal(blocks.sum(-1), 7)
    for kept in blocks.reshape(-1, 21):
        slots = np.flatnonzero(kept) + 5
        block_of = slots // 8
        sizes = {q: len(range(max(8 * q, 5), min(8 * q + 8, 26))) for q in set(block_of.tolist())}
        partial = [q for q in sizes if (block_of == q).sum() < sizes[q]]
        assert len(partial) <= 1  # blocks are taken whole but for the one that completes n_select
        for q in partial:  # ... which gives its lowest slots
            got = slots[block_of == q]
            np.testing.assert_array_equal(got, np.arange(max(8 * q, 5), max(8 * q, 5) + len(got)))


# --- cross-lowering (no device needed): Qwen3-4B, Qwen3-32B, Phi-4-reasoning at T=2048, w=i=64, batch 8
MODELS = {"Qwen3-4B": (36, 8), "Qwen3-32B": (64, 8), "Phi-4-reasoning": (40, 10)}
T, W, BATCH, MAX_NEW = 2048, 64, 8, 32768
_LOWER_POLICY = RandomAttention(budget=T, window=W)
CAPACITIES = [
    padded_capacity(_LOWER_POLICY, 1024, MAX_NEW),  # max(P, T) + i = 2112 -> 2176
    padded_capacity(_LOWER_POLICY, 3000, MAX_NEW),  # 3064 -> 3072
    _LOWER_POLICY.capacity(3000, MAX_NEW),  # 3064: not a multiple of 128 (nor a power of two)
]


def test_lowering_capacities():
    assert CAPACITIES == [2176, 3072, 3064]


def _lower(platform, layers, kv_heads, capacity, protect="prompt", **static):
    target = {"tpu": "tpu", "triton": "cuda"}[platform]
    rule = EvictionRule(T, W, W, protect)

    def round_(positions, prompt_lens, generated, n_select, row_seeds, seed):
        return random_keep_mask(positions, prompt_lens, generated, n_select, row_seeds, seed, rule=rule,
                                platform=platform, interpret=False, **static)

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    lowered = jax.jit(round_).trace(
        i32(layers, BATCH, kv_heads, capacity), i32(BATCH), i32(BATCH), i32(BATCH), i32(BATCH), i32()
    ).lower(lowering_platforms=(target,))
    return lowered.as_text()


_MARKER = {"tpu": "tpu_custom_call", "triton": "__gpu$xla.gpu.triton"}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_cross_lowers_for_tpu_and_triton(platform, model, capacity):
    text = _lower(platform, *MODELS[model], capacity)
    assert _MARKER[platform] in text


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("static", [
    dict(shared_across_heads=True), dict(slots_per_draw=16), dict(slots_per_draw=3, protect="sinks:4"),
    dict(protect="none"),
], ids=["shared", "spd16", "spd3-sinks4", "none"])
def test_cross_lowers_policy_variants(platform, static):
    assert _MARKER[platform] in _lower(platform, *MODELS["Phi-4-reasoning"], CAPACITIES[0], **static)


def test_backend_field():
    assert RandomAttention().backend == "auto"
    # "auto" follows the platform the decode program is built for, never the process' default backend
    assert RandomAttention().resolved_backend("cpu") == "xla"
    assert RandomAttention().resolved_backend("gpu") == "pallas"
    assert RandomAttention().resolved_backend("tpu") == "pallas"
    assert RandomAttention(backend="pallas").resolved_backend("cpu") == "pallas"
    assert RandomAttention(backend="xla").resolved_backend("tpu") == "xla"
    with pytest.raises(ValueError, match="platform must be one of"):
        RandomAttention().resolved_backend("cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        RandomAttention(backend="triton")
    with pytest.raises(ValueError, match="slots_per_draw must be a positive integer"):
        RandomAttention(slots_per_draw=0)
    with pytest.raises(ValueError, match="convention= is gone"):
        RandomAttention(budget=64, convention="text")
    with pytest.raises(ValueError, match="platform must be one of"):
        random_keep_mask(jnp.zeros((1, 1, 1, 4), jnp.int32), *[jnp.zeros((1,), jnp.int32)] * 4, 0,
                         rule=EvictionRule(4, 2, 2), platform="mosaic_gpu", interpret=True)


# --- statistics of the kernel's keep-sets
P, N, KS, L, B, H, WS = 4, 48, 16, 4, 8, 8, 8  # prompt, eligible candidates, n_select, layers, rows, heads, window
S = P + N + WS
STAT_RULE = EvictionRule(budget=P + KS + WS, window=WS, interval=WS)  # K_sel = P + KS: n_select = KS


def _stat_rounds(n_calls, rounds, **static):
    """keep [calls, rounds, L, B, H, N] over the N candidates, fresh row seeds per call.

    Each head holds the prompt, positions P .. P + N - 1 and the window of the round; round m
    is the one at generated = i * (8 + m), so the window lies past every candidate and only the
    round's identity (its generated count) changes between rounds."""
    assert (STAT_RULE.n_select(jnp.int32(P)) == KS) and STAT_RULE.n_pinned(jnp.int32(P)) == P
    prompt, n_select = jnp.full((B,), P, jnp.int32), jnp.full((B,), KS, jnp.int32)
    out = []
    for call in range(n_calls):
        seeds = jnp.arange(B, dtype=jnp.int32) + B * call
        per_round = []
        for m in range(rounds):
            g = WS * (8 + m)
            pos = np.empty((L, B, H, S), np.int32)
            pos[..., : P + N] = np.arange(P + N)
            pos[..., P + N :] = np.arange(P + g - WS, P + g)
            generated = jnp.full((B,), g, jnp.int32)
            assert bool(jnp.all(STAT_RULE.due(jnp.full((B,), S, jnp.int32), generated)))
            keep = np.asarray(random_keep_mask(jnp.asarray(pos), prompt, generated, n_select, seeds, 7,
                                               rule=STAT_RULE, platform="tpu", interpret=True, **static))
            assert keep[..., :P].all() and keep[..., P + N :].all()  # pinned prompt and window
            per_round.append(keep[..., P : P + N])
        out.append(per_round)
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
    _overlap_matches_hypergeometric(keeps[:, 0], keeps[:, 1])  # rounds (generated 64 vs 72)
    _overlap_matches_hypergeometric(keeps[:, :, :, :-1], keeps[:, :, :, 1:])  # rows (row seeds)


def test_shared_across_heads_shares_and_blocks_come_whole():
    shared = _stat_rounds(1, 1, shared_across_heads=True)[0, 0]
    assert (shared == shared[:, :, :1]).all()  # every head keeps the same set
    shared = _stat_rounds(4, 1, shared_across_heads=True)[:, 0, :, :, 0]  # [calls, L, B, N]: head 0
    _overlap_matches_hypergeometric(shared[:, :-1], shared[:, 1:])  # layers still independent
    blocks = _stat_rounds(1, 1, slots_per_draw=4)[0, 0]  # candidates 4 .. 51 = 12 whole blocks of 4
    per_block = blocks.reshape(L, B, H, N // 4, 4).sum(-1)
    assert set(np.unique(per_block).tolist()) <= {0, 4}


# --- end to end: generate() with the kernel in the decode loop
def test_generate_pallas_equals_xla(tiny_model):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 11)]
    policy = RandomAttention(budget=24, buffer=8, seed=3)  # T = 24, w = i = 8: K_sel = 16
    runs = {}
    for backend in ("xla", "pallas"):
        runs[backend] = randkv_jax.generate(
            tiny_model, prompts, policy=dataclasses.replace(policy, backend=backend), max_new_tokens=80,
            chat=False, ignore_eos=True, return_state=True, seed=[4, 5, 6], temperature=1.0,
        )
    xla, pallas = runs["xla"], runs["pallas"]
    for p, s in zip(prompts, pallas.stats):
        assert s.evictions >= 5
        assert s.held_after_round == policy.budget  # every round compacts to exactly T
        assert s.peak_slots <= policy.capacity(len(p), 80)
    assert pallas.tokens == xla.tokens
    np.testing.assert_array_equal(np.asarray(pallas.state.buffer.positions), np.asarray(xla.state.buffer.positions))
    np.testing.assert_array_equal(np.asarray(pallas.state.buffer.keys), np.asarray(xla.state.buffer.keys))
