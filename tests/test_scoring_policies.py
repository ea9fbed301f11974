"""SnapKV, R-KV and VaSE against straightforward NumPy versions of their published rules.

The references below loop over rows, heads and slots in float64 and read the formulas as written
in the sources (engine `kvcompress/engine/cache_utils.py`, R-KV `rkv/utils.py`, VaSE
`cache_utils.py`): softmax over the candidate list, torch's zero-padded avg_pool1d and
max_pool1d, R-KV's threshold rule on the dense candidate list, VaSE's two-stage selection. Their
sums are `math.fsum` (correctly rounded, so equal multisets give equal sums: a tie built into the
data stays an exact tie in float64). They are compared on random tensors with GQA groups, holes
in the candidates, pooling edges and ties; whole rounds (the budget rule, written here
independently of `randkv_jax.rule`) are compared with a tie-aware check; then each policy runs
through `generate` on a tiny model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import randkv_jax
from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.hash_prng import eviction_draws
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.rkv import RKV, RKV_PRESETS, rkv_scores
from randkv_jax.policies.snapkv import SnapKV, snapkv_scores
from randkv_jax.policies.vase import VaSE, gumbel, vase_scores
from randkv_jax.rule import select_top
from tests.budget_rule import simulate_fill

# jitted once per static configuration and shape (compiling dominates the run time on CPU)
snapkv_jit = jax.jit(snapkv_scores, static_argnames=("kernel", "pool", "group"))
rkv_jit = jax.jit(rkv_scores, static_argnums=3)
vase_jit = jax.jit(vase_scores)
select_top_jit = jax.jit(select_top)
# a round's keep mask and the scores it ranked, in one program per policy
round_jit = jax.jit(lambda policy, buffer, seeds, obs: (policy.keep_mask(buffer, seeds, obs, platform="cpu"),
                                                        policy.scores(buffer, seeds, obs)), static_argnums=0)

# ---------------------------------------------------------------- NumPy references (float64)


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / math.fsum(e)


def np_pool(x, kernel, mode):
    """torch avg_pool1d / max_pool1d, stride 1, padding kernel // 2 (avg counts the zero padding)."""
    out = np.zeros_like(x)
    for j in range(len(x)):
        window = [x[t] for t in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= t < len(x)]
        out[j] = math.fsum(window) / kernel if mode == "avg" else max(window)
    return out


def np_snapkv(q, keys, cand, preset):
    """Engine `attn --smooth` ("paper") or R-KV repo SnapKV ("rkv-repo"); non-candidates hold 0."""
    b, h, w, d = q.shape
    k, s = keys.shape[1], keys.shape[2]
    g = h // k
    out = np.zeros((b, k, s))
    for row, kv in itertools.product(range(b), range(k)):
        idx = np.flatnonzero(cand[row, kv])
        if len(idx) == 0:
            continue
        group = range(kv * g, (kv + 1) * g)
        if preset == "paper":
            per_head = []
            for hq in group:
                probs = np.zeros(s)
                for t in range(w):
                    logits = np.array([q[row, hq, t] @ keys[row, kv, j] for j in idx]) / np.sqrt(d)
                    probs[idx] += np_softmax(logits) / w
                per_head.append(np_pool(probs, 5, "avg"))
            out[row, kv] = np.mean(per_head, axis=0)
        else:
            probs = np.zeros(s)
            for t in range(w):
                logits = np.array([max(q[row, hq, t] @ keys[row, kv, j] for hq in group) for j in idx])
                probs[idx] += np_softmax(logits / np.sqrt(d)) / w
            out[row, kv] = np_pool(probs, 7, "max")
    return out


def np_redundancy(keys, cand, threshold, cases=None):
    """softmax_j(mean_i C_ij) on the dense candidate list; R-KV's cal_similarity when thresholded."""
    b, k, s, _ = keys.shape
    out = np.zeros((b, k, s))
    for row, kv in itertools.product(range(b), range(k)):
        idx = np.flatnonzero(cand[row, kv])
        if len(idx) == 0:
            continue
        kk = keys[row, kv, idx]
        unit = kk / (np.linalg.norm(kk, axis=1, keepdims=True) + 1e-8)
        sim = unit @ unit.T
        np.fill_diagonal(sim, 0.0)
        if threshold is not None:
            for i in range(len(idx)):
                similar = [j for j in range(len(idx)) if sim[i, j] > threshold]
                if cases is not None:
                    cases.add("spared" if similar else "fallback")
                sim[i, max(similar) if similar else 0] = 0.0
        out[row, kv, idx] = np_softmax(np.array([math.fsum(column) for column in sim.T]) / len(idx))
    return out


def np_rkv(q, keys, cand, preset):
    st = RKV_PRESETS[preset]
    attention = np_snapkv(q, keys, cand, "paper" if preset == "paper" else "rkv-repo")
    return st.mix_lambda * attention - (1 - st.mix_lambda) * np_redundancy(keys, cand, st.threshold)


def np_top(scores, eligible, k):
    """The k highest-scoring eligible slots, ties to the lower slot."""
    idx = [j for j in np.flatnonzero(eligible)]
    return sorted(idx, key=lambda j: (-scores[j], j))[:k]


def np_vase_keep(q, keys, values, positions, cand, eligible, n_large, kept, noise):
    """VaSE's two-stage rule per row and KV head: top n_large value ranges (first 4 positions
    pinned), then kept - n_large Gumbel-top-k draws proportional to the SnapKV "paper" score.

    Returns the keep mask and the priority it amounts to (+inf on the large set, the draw key
    log(attention) + noise elsewhere), for the tie-aware comparison."""
    attention = np_snapkv(q, keys, cand, "paper")
    b, k, s = positions.shape
    keep = np.zeros((b, k, s), bool)
    priority = np.zeros((b, k, s))
    for row, kv in itertools.product(range(b), range(k)):
        value_range = values[row, kv].max(-1) - values[row, kv].min(-1)
        value_range = np.where(positions[row, kv] < 4, np.inf, value_range)
        large = np_top(value_range, eligible[row, kv], n_large[row])
        rest = eligible[row, kv].copy()
        rest[large] = False
        with np.errstate(divide="ignore"):
            key = np.log(attention[row, kv]) + noise[row, kv]
        sampled = np_top(key, rest, kept[row] - n_large[row])
        keep[row, kv, large + sampled] = True
        priority[row, kv] = key
        priority[row, kv, large] = np.inf
    return keep, priority


def np_gumbel(draws):
    u = (np.asarray(draws, np.int64) // 2 + 0.5) / 2**23  # hash_prng.open_uniform, read as written
    return -np.log(-np.log(u))


# ---------------------------------------------------------------- pure functions on random tensors


def _tensors(rng, b=2, k=2, g=2, w=6, s=23, d=16, holes=True, clustered=False):
    q = rng.normal(size=(b, k * g, w, d))
    keys = rng.normal(size=(b, k, s, d))
    if clustered:  # three directions plus noise: many pairs above cosine 0.5, some keys alone
        centers = rng.normal(size=(3, d))
        keys = np.where(rng.random((b, k, s, 1)) < 0.7, centers[rng.integers(0, 3, (b, k, s))], 0) + 0.6 * keys
    cand = rng.random((b, k, s)) < 0.75 if holes else np.ones((b, k, s), bool)
    cand[..., 0] = rng.random((b, k)) < 0.5  # pooling edges: first / last slot in or out
    cand[..., -1] = rng.random((b, k)) < 0.5
    cand[0, 0] = True  # a head without holes
    return q, keys, cand


def _f32(*xs):
    return [jnp.asarray(x, jnp.float32) if x.dtype != bool else jnp.asarray(x) for x in xs]


@pytest.mark.parametrize("preset", ["paper", "rkv-repo"])
@pytest.mark.parametrize("g", [2, 4])
def test_snapkv_scores_equal_numpy(preset, g):
    rng = np.random.default_rng(g)
    q, keys, cand = _tensors(rng, g=g, w=8 if preset == "rkv-repo" else 6)
    st = SnapKV(preset=preset, buffer=8).settings
    ours = snapkv_jit(*_f32(q, keys, cand), kernel=st.kernel, pool=st.pool, group=st.group)
    np.testing.assert_allclose(np.asarray(ours), np_snapkv(q, keys, cand, preset), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_rkv_scores_equal_numpy(preset):
    rng = np.random.default_rng(10)
    q, keys, cand = _tensors(rng, g=2, w=8, clustered=True)
    ours = rkv_jit(*_f32(q, keys, cand), RKV(preset=preset, buffer=8).settings)
    np.testing.assert_allclose(np.asarray(ours), np_rkv(q, keys, cand, preset), rtol=2e-5, atol=1e-6)
    if preset == "official":  # the data exercise both branches of the "retain last" rule
        cases = set()
        np_redundancy(keys, cand, 0.5, cases)
        assert cases == {"spared", "fallback"}


def test_rkv_official_spares_the_newest_similar_copy():
    """Three identical keys and one orthogonal: the rule zeroes C[i, newest copy other than i]."""
    keys = np.zeros((1, 1, 4, 2))
    keys[0, 0, [0, 1, 3]] = [1.0, 0.0]
    keys[0, 0, 2] = [0.0, 1.0]
    cand = np.ones((1, 1, 4), bool)
    q = np.zeros((1, 1, 8, 2))
    ours = np.asarray(rkv_jit(*_f32(q, keys, cand), RKV_PRESETS["official"]))
    # column sums of C after the rule: rows 0 and 1 spare 3, row 3 spares 1, row 2 spares 0 (fallback)
    sums = np.array([1.0 + 1.0, 1.0 + 1.0 - 1.0, 0.0, 1.0 + 1.0 - 2.0])
    red = np_softmax(sums / 4)
    np.testing.assert_allclose(ours[0, 0], 0.1 * 0.25 - 0.9 * red, rtol=1e-5)  # uniform attention 1/4


def test_vase_priority_top_k_is_the_two_stage_rule():
    rng = np.random.default_rng(20)
    b, k, s = 3, 2, 29
    q, keys, cand = _tensors(rng, b=b, k=k, g=4, s=s)
    values = rng.normal(size=(b, k, s, 8))
    values[:, :, 10:14] = values[:, :, 9:10]  # equal value ranges: ties go to the older slot
    positions = np.broadcast_to(np.arange(s) + rng.integers(0, 3, (b, k, 1)), (b, k, s)).copy()
    eligible = cand & (rng.random((b, k, s)) < 0.85)
    n_large, kept = np.array([3, 5, 0]), np.array([9, 7, 6])
    noise = np_gumbel(rng.integers(0, 2**24, (b, k, s)))
    priority = vase_jit(*_f32(q, keys, values), jnp.asarray(positions), jnp.asarray(cand), jnp.asarray(eligible),
                        jnp.asarray(n_large), jnp.asarray(noise, jnp.float32))
    ours = np.asarray(select_top_jit(priority, jnp.asarray(eligible), jnp.asarray(kept)[:, None]))
    expected, _ = np_vase_keep(q, keys, values, positions, cand, eligible, n_large, kept, noise)
    np.testing.assert_array_equal(ours, expected)
    # the sampled part's priority is log(attention) + noise
    finite = np.isfinite(np.asarray(priority)) & eligible
    with np.errstate(divide="ignore"):
        want = np.log(np_snapkv(q, keys, cand, "paper")) + noise
    np.testing.assert_allclose(np.asarray(priority)[finite], want[finite], rtol=1e-5, atol=1e-5)


def _inclusion_probabilities(weights, m):
    """P(slot in sample) for m successive draws without replacement, proportional to weights."""
    p = np.zeros(len(weights))
    for seq in itertools.permutations(range(len(weights)), m):
        prob, left = 1.0, weights.sum()
        for j in seq:
            prob *= weights[j] / left
            left -= weights[j]
        p[list(seq)] += prob
    return p


@pytest.mark.parametrize("logits, n_draws", [
    ([1.0, 0.5, 6.0, 1.0, 0.2, 1.5, 3.0, 0.8], 2),
    ([1.0, 0.5, 2.0, 1.0, 0.2, 1.5, 400.0, 0.8], 4),  # slot 6 heavy: avg-pooling spreads it over 4..7
])
def test_vase_sampling_frequencies_follow_the_attention(logits, n_draws):
    """Over many row seeds, the Gumbel-top-k draws include each slot as often as successive
    proportional draws do (exact probabilities by enumeration); heavy slots are nearly always kept."""
    n_rows, s, d = 4000, 8, 4
    rng = np.random.default_rng(5)
    q = np.zeros((1, 1, 2, d))
    q[0, 0, :, 0] = np.sqrt(d)  # logit of slot j = keys[j, 0]
    keys = np.zeros((1, 1, s, d))
    keys[0, 0, :, 0] = np.log(logits)
    values = rng.normal(size=(1, 1, s, 3)) * 0.1
    values[0, 0, 3] = [-5.0, 0.0, 5.0]  # slot 3: the large set (n_large = 1)
    positions = np.arange(10, 10 + s)[None, None]  # no sinks
    cand = np.ones((1, 1, s), bool)
    weights = np.where(np.arange(s) == 3, 0.0, np_snapkv(q, keys, cand, "paper")[0, 0])
    exact = _inclusion_probabilities(weights, n_draws)

    rep = lambda x, dtype: jnp.asarray(np.broadcast_to(x, (n_rows, *x.shape[1:])), dtype)  # noqa: E731
    draws = eviction_draws(0, jnp.arange(n_rows)[:, None, None], 0, 0, 24, jnp.arange(s)[None, None])
    priority = vase_jit(rep(q, jnp.float32), rep(keys, jnp.float32), rep(values, jnp.float32),
                        rep(positions, jnp.int32), rep(cand, bool), rep(cand, bool),
                        jnp.ones(n_rows, jnp.int32), gumbel(draws))
    kept = np.asarray(select_top_jit(priority, rep(cand, bool), jnp.full((n_rows, 1), 1 + n_draws))[:, 0])
    assert kept[:, 3].all()
    frequency = np.where(np.arange(s) == 3, 0.0, kept.mean(axis=0))
    np.testing.assert_allclose(frequency, exact, atol=0.03)
    if n_draws == 4:
        assert (exact[4:] > 0.95).all() and (frequency[4:] > 0.93).all()


# ---------------------------------------------------------------- the budget rule, written independently


def np_rule(policy, positions, prompt_lens, generated, fill):
    """The shared eviction rule read from its description (not from `randkv_jax.rule`).

    K_sel = budget - window; pinned = valid prompt positions below min(P, N, K_sel - 1) (N = P for
    "prompt", 0 for "none", N for "sinks:N"); window = valid positions >= P + generated - window;
    candidates (the attention softmax) = valid outside the window; eligible = valid, neither pinned
    nor in the window; a row is due when generated is a positive multiple of the interval and it
    holds more than `budget` entries; a due row keeps its pinned and window entries and the
    n_select = K_sel - pinned best eligible ones. Returns a dict of [l, b, k, s] masks and [b]
    arrays."""
    pos = np.asarray(positions)
    prompt, gen, fill = np.asarray(prompt_lens), np.asarray(generated), np.asarray(fill)
    per_row = lambda x: x[None, :, None, None]  # noqa: E731
    selected = policy.budget - policy.window
    if policy.protect == "prompt":
        sinks = prompt
    elif policy.protect == "none":
        sinks = np.zeros_like(prompt)
    else:
        sinks = np.full_like(prompt, int(policy.protect.split(":")[1]))
    n_pinned = np.minimum(np.minimum(prompt, sinks), selected - 1)
    valid = pos >= 0
    pinned = valid & (pos < per_row(n_pinned))
    window = valid & (pos >= per_row(prompt + gen - policy.window))
    due = (gen > 0) & (gen % policy.interval == 0) & (fill > policy.budget)
    assert not (pinned & window)[:, due].any()  # never both in a due row (P + generated > budget)
    return dict(valid=valid, pinned=pinned, window=window, candidates=valid & ~window,
                eligible=valid & ~pinned & ~window, due=due, n_pinned=n_pinned, n_select=selected - n_pinned)


# ---------------------------------------------------------------- tie-aware comparison of keep sets

TIE_RTOL = 1e-5
"""Reference scores closer than this (relative to the head's score scale) may be ordered either
way by float32: far above float32 rounding of these scores (~1e-7), far below real score gaps."""


def assert_keep_matches(ours, expected, scores, rule, rtol=TIE_RTOL):
    """Compare a round's keep mask `ours` [l, b, k, s] with the reference `expected`, tolerating
    float32-vs-float64 order flips between near-equal reference `scores`.

    Rows not due keep exactly their valid entries. In a due (layer, row, head): every pinned and
    window entry is kept, nothing invalid is, exactly min(n_select, #eligible) eligible entries are
    kept, and every kept eligible entry's reference score is >= every dropped one's minus
    tol = rtol * (largest finite |score| among the head's eligible entries). A head whose cut is
    clear (its n-th and (n+1)-th best reference scores more than tol apart) must equal `expected`
    exactly. Returns the number of due heads whose cut is a near-tie (where only the tie-aware
    condition applies)."""
    ours = np.asarray(ours)
    near_ties = 0
    for li, row, kv in np.ndindex(*ours.shape[:3]):
        at = (li, row, kv)
        got, valid = ours[at], rule["valid"][at]
        assert not (got & ~valid).any(), f"{at}: keeps an empty slot"
        if not rule["due"][row]:
            assert (got == valid).all(), f"{at}: a row that is not due must keep every entry"
            continue
        protected = rule["pinned"][at] | rule["window"][at]
        assert got[protected].all(), f"{at}: drops a pinned or window entry"
        eligible, s = rule["eligible"][at], np.asarray(scores[at], np.float64)
        n = min(int(rule["n_select"][row]), int(eligible.sum()))
        kept, dropped = got & eligible, eligible & ~got
        assert kept.sum() == n, f"{at}: keeps {kept.sum()} eligible entries, not {n}"
        finite = s[eligible][np.isfinite(s[eligible])]
        tol = rtol * (float(np.abs(finite).max()) if finite.size else 0.0)
        if kept.any() and dropped.any():
            worst_kept, best_dropped = s[kept].min(), s[dropped].max()
            assert worst_kept >= best_dropped - tol, (
                f"{at}: keeps a slot scored {worst_kept!r} but drops one scored {best_dropped!r} (tol {tol:.2e})")
        ranked = np.sort(s[eligible])[::-1]
        if 0 < n < len(ranked) and not ranked[n - 1] - ranked[n] > tol:
            near_ties += 1
        else:
            np.testing.assert_array_equal(got, expected[at], err_msg=f"{at}: clear cut, different keep set")
    return near_ties


def _one_head_rule(eligible, n_select, due=True, pinned=None):
    eligible = np.asarray(eligible)[None, None, None]
    pinned = np.zeros_like(eligible) if pinned is None else np.asarray(pinned)[None, None, None]
    return dict(valid=eligible | pinned, pinned=pinned, window=np.zeros_like(eligible), eligible=eligible,
                due=np.array([due]), n_select=np.array([n_select]))


def test_tie_aware_check_fails_on_wrong_keep_sets():
    """The check accepts the right set and either side of a near-tie, and rejects the rest."""
    scores = np.array([[[[0.9, 0.5, 0.1, 0.7, 0.5 + 1e-9]]]])
    rule = _one_head_rule([True] * 5, 3)
    right = np.array([[[[True, True, False, True, False]]]])
    swapped_tie = np.array([[[[True, False, False, True, True]]]])  # 0.5 + 1e-9 for 0.5: a near-tie
    assert assert_keep_matches(right, right, scores, rule) == 1
    assert assert_keep_matches(swapped_tie, right, scores, rule) == 1
    for wrong in ([True, True, True, False, False],  # 0.1 kept, 0.7 dropped
                  [True, True, False, False, False],  # too few
                  [True, True, True, True, False]):  # too many
        with pytest.raises(AssertionError):
            assert_keep_matches(np.array(wrong)[None, None, None], right, scores, rule)
    # a clear cut must be the reference's exact set, even if the scores of the wrong set look close
    clear = np.array([[[[0.9, 0.5, 0.1, 0.7, 0.2]]]])
    with pytest.raises(AssertionError):
        assert_keep_matches(right, swapped_tie, clear, rule)
    # protected entries and rows not due
    pinned = [False, False, False, False, True]
    rule = _one_head_rule([True, True, True, True, False], 2, pinned=pinned)
    keep = np.array([[[[True, False, False, True, True]]]])
    assert assert_keep_matches(keep, keep, scores, rule) == 0
    with pytest.raises(AssertionError):
        assert_keep_matches(np.array([[[[True, True, False, True, False]]]]), keep, scores, rule)
    rule = _one_head_rule([True] * 5, 3, due=False)
    assert assert_keep_matches(np.ones((1, 1, 1, 5), bool), right, scores, rule) == 0
    with pytest.raises(AssertionError):
        assert_keep_matches(right, right, scores, rule)


# ---------------------------------------------------------------- keep masks of whole buffers

# rows of the simulated round: prompt length, generated count, entries held minus the budget.
# Row 0: a prompt longer than K_sel (all of it held: its tail competes); rows 0, 1 due; row 2
# holds exactly the budget and row 3 is off the interval (not due); row 4: nothing generated yet.
PROMPT_LENS = [9, 3, 4, 5, 20]
GENERATED = [16, 24, 16, 20, 0]
OVER_BUDGET = [5, 6, 0, 4, None]  # None: the prompt only
ROW_SEEDS = np.array([7, 8, 9, 10, 11])


def _buffer(rng, policy, *, l=2, k=2, g=2, d=8, ties=False):
    """A buffer mid-generation: per (layer, row, KV head) the row's pinned positions (the whole
    prompt in row 0), a sorted random subset of its other positions before the window, then the
    window (the `policy.window` newest positions), then empty slots. `fill` = entries held,
    `generated` as in GENERATED.

    With `ties`, every key is the same axis-aligned vector and every value row the same: equal
    attention, equal redundancy, equal value ranges, computed exactly alike for every slot in
    float32 and in float64 (products with 0 and sums of equal values), so ties are exact in both
    precisions and go to the lower slot."""
    b = len(PROMPT_LENS)
    w = policy.window
    selected = policy.budget - w
    fills = [p if over is None else policy.budget + over for p, over in zip(PROMPT_LENS, OVER_BUDGET)]
    s = max(fills) + 3
    positions = np.full((l, b, k, s), -1)
    for li, row, kv in itertools.product(range(l), range(b), range(k)):
        p, n = PROMPT_LENS[row], GENERATED[row]
        start = p + n - w  # the window: [start, p + n)
        sinks = p if policy.protect == "prompt" else 0 if policy.protect == "none" else int(policy.protect[6:])
        fixed = np.arange(p if row == 0 else min(p, sinks, selected - 1))
        others = np.setdiff1d(np.arange(start), fixed)
        history = np.sort(rng.choice(others, fills[row] - w - len(fixed), replace=False))
        positions[li, row, kv, : fills[row]] = np.concatenate([fixed, history, np.arange(start, start + w)])
    keys = rng.normal(size=(l, b, k, s, d))
    values = rng.normal(size=(l, b, k, s, d))
    if ties:
        keys = np.zeros_like(keys)
        keys[..., 0] = 1.0
        values = np.broadcast_to(values[:, :, :, :1], values.shape).copy()
    buffer = KVBuffer(
        keys=jnp.asarray(keys, jnp.float32), values=jnp.asarray(values, jnp.float32),
        positions=jnp.asarray(positions, jnp.int32), prompt_lens=jnp.asarray(PROMPT_LENS, jnp.int32),
        fill=jnp.asarray(fills, jnp.int32), generated=jnp.asarray(GENERATED, jnp.int32),
    )
    queries = rng.normal(size=(l, b, k * g, policy.needs.query_window, d))
    return buffer, Observations(queries=jnp.asarray(queries, jnp.float32)), queries


def _np_rule_of(policy, buffer):
    rule = np_rule(policy, buffer.positions, buffer.prompt_lens, buffer.generated, buffer.fill)
    np.testing.assert_array_equal(rule["valid"][0, :, 0].sum(-1), np.asarray(buffer.fill))  # fill = held
    return rule


def _np_keep(policy, buffer, queries, row_seeds):
    """The reference round: (keep mask, float64 scores of the eligible slots' ranking) [l, b, k, s]."""
    rule = _np_rule_of(policy, buffer)
    keys, values = np.asarray(buffer.keys, np.float64), np.asarray(buffer.values, np.float64)
    pos, generated = np.asarray(buffer.positions), np.asarray(buffer.generated)
    l, b, k, s = pos.shape
    keep = rule["pinned"] | rule["window"]
    scores = np.zeros((l, b, k, s))
    n_select = rule["n_select"]
    for li in range(l):
        cand, eligible = rule["candidates"][li], rule["eligible"][li]
        if isinstance(policy, VaSE):
            n_large = np.minimum(policy.budget // 4 if policy.n_large is None else policy.n_large, n_select)
            noise = np_gumbel(eviction_draws(policy.seed, jnp.asarray(row_seeds)[:, None, None], li,
                                             jnp.arange(k)[None, :, None], jnp.asarray(generated)[:, None, None],
                                             jnp.arange(s)[None, None]))
            chosen, scores[li] = np_vase_keep(queries[li], keys[li], values[li], pos[li], cand, eligible,
                                              n_large, n_select, noise)
            keep[li] |= chosen
            continue
        if isinstance(policy, SnapKV):
            scores[li] = np_snapkv(queries[li], keys[li], cand, policy.preset)
        else:
            scores[li] = np_rkv(queries[li], keys[li], cand, policy.preset)
        for row, kv in itertools.product(range(b), range(k)):
            keep[li, row, kv, np_top(scores[li, row, kv], eligible[row, kv], n_select[row])] = True
    return np.where(rule["due"][None, :, None, None], keep, rule["valid"]), scores, rule


POLICIES = {
    "snapkv-paper": SnapKV(budget=13, window=5, interval=8),
    "snapkv-rkv-repo": SnapKV(budget=14, buffer=8, preset="rkv-repo"),
    "rkv-paper": RKV(budget=14, buffer=8),
    "rkv-official": RKV(budget=14, buffer=8, preset="official"),
    "vase": VaSE(budget=14, buffer=8),
    "vase-n_large": VaSE(budget=14, window=6, interval=8, n_large=5, seed=3),
}

# every policy in its default regime (protect "none"), the other protections on a few (compiles cost)
KEEP_CASES = [(name, "none") for name in sorted(POLICIES)] + [
    ("snapkv-paper", "prompt"), ("rkv-paper", "prompt"), ("vase", "prompt"), ("vase", "sinks:3")]


@pytest.mark.parametrize("name, protect", KEEP_CASES)
def test_keep_mask_equals_numpy(name, protect):
    policy = dataclasses.replace(POLICIES[name], protect=protect)
    rng = np.random.default_rng(sorted(POLICIES).index(name) * 10 + len(protect))
    for ties in (False, True):
        buffer, obs, queries = _buffer(rng, policy, ties=ties)
        ours, our_scores = map(np.asarray, round_jit(policy, buffer, jnp.asarray(ROW_SEEDS), obs))
        expected, scores, rule = _np_keep(policy, buffer, queries, ROW_SEEDS)
        np.testing.assert_array_equal(rule["due"], [True, True, False, False, False])
        np.testing.assert_array_equal(np.asarray(policy.due(buffer)), rule["due"])
        masks = policy.round_masks(buffer)
        for field in ("pinned", "window", "eligible", "candidates"):
            np.testing.assert_array_equal(np.asarray(getattr(masks, field)), rule[field], err_msg=field)

        near_ties = assert_keep_matches(ours, expected, scores, rule)
        if not ties and name != "snapkv-rkv-repo":  # max-pooling alone makes exact ties on random data
            assert near_ties == 0, "random scores: every cut must be clear, so the sets are compared exactly"
        # float32 scores: the reference's on the eligible slots (the large set's +inf included)
        eligible = rule["eligible"] & rule["due"][None, :, None, None]
        np.testing.assert_array_equal(np.isinf(our_scores[eligible]), np.isinf(scores[eligible]))
        finite = eligible & np.isfinite(scores)
        rtol, atol = (1e-5, 1e-5) if isinstance(policy, VaSE) else (2e-5, 1e-6)  # as the score tests above
        np.testing.assert_allclose(our_scores[finite], scores[finite], rtol=rtol, atol=atol)
        # the mask is the top n_select of those float32 scores, ties to the lower slot
        top = rule["valid"].copy()
        for at in np.ndindex(*ours.shape[:3]):
            if rule["due"][at[1]]:
                top[at] = rule["pinned"][at] | rule["window"][at]
                top[at][np_top(our_scores[at], rule["eligible"][at], rule["n_select"][at[1]])] = True
        np.testing.assert_array_equal(ours, top)

        held = ours.sum(-1)  # [l, b, k]
        assert (held[:, rule["due"]] == policy.budget).all()
        assert (held[:, ~rule["due"]] == np.asarray(buffer.fill)[~rule["due"]][None, :, None]).all()


def test_vase_draws_depend_on_seeds_only():
    policy = POLICIES["vase"]
    rng = np.random.default_rng(0)
    buffer, obs, _ = _buffer(rng, policy)
    mask = lambda p, seeds: np.asarray(round_jit(p, buffer, jnp.asarray(seeds), obs)[0])  # noqa: E731
    a = mask(policy, ROW_SEEDS)
    np.testing.assert_array_equal(a, mask(policy, ROW_SEEDS))
    assert not np.array_equal(a, mask(policy, ROW_SEEDS + 10))
    assert not np.array_equal(a, mask(dataclasses.replace(policy, seed=1), ROW_SEEDS))


def test_presets_needs_and_validation():
    assert SnapKV().needs == ScoringNeeds(query_window=64) and SnapKV().protect == "none"
    assert SnapKV(preset="rkv-repo").needs == ScoringNeeds(query_window=8)
    assert SnapKV(budget=100, window=16, interval=32).needs == ScoringNeeds(query_window=32)  # the interval's queries
    assert RKV(buffer=32).needs == ScoringNeeds(query_window=32)
    assert RKV(preset="official").needs == ScoringNeeds(query_window=8)
    assert VaSE(buffer=16).needs == ScoringNeeds(query_window=16) and VaSE().protect == "none"
    assert VaSE(budget=100, window=16, interval=32).needs == ScoringNeeds(query_window=32)
    assert RKV_PRESETS["paper"].mix_lambda == 0.5 and RKV_PRESETS["official"].mix_lambda == 0.1
    # n_large = budget // 4 (VaSE's T/4 at every budget), never more than the row's K_sel - pinned
    lens = jnp.asarray([5, 500, 2000])
    np.testing.assert_array_equal(VaSE(budget=1024).large_per_row(lens), [256, 256, 256])
    np.testing.assert_array_equal(VaSE(budget=4096).large_per_row(lens), [1024, 1024, 1024])
    np.testing.assert_array_equal(VaSE(budget=100).large_per_row(lens), [25, 25, 25])
    np.testing.assert_array_equal(VaSE(budget=100, n_large=256).large_per_row(lens), [36, 36, 36])
    # protect "prompt": K_sel - 1 = 959 pinned at most, so 1024 - 64 - 959 = 1 entry is selected
    np.testing.assert_array_equal(VaSE(budget=1024, protect="prompt").large_per_row(lens), [256, 256, 1])
    with pytest.raises(ValueError, match="preset must be one of"):
        SnapKV(preset="max")
    with pytest.raises(ValueError, match="query window 8 exceeds the interval"):
        RKV(buffer=4, preset="official")
    with pytest.raises(ValueError, match="query window 8 exceeds the interval"):
        SnapKV(budget=100, window=16, interval=4, preset="rkv-repo")
    with pytest.raises(ValueError, match="n_large"):
        VaSE(n_large=-1)
    with pytest.raises(TypeError):  # the "paper" / "original" presets are gone
        VaSE(preset="original")
    with pytest.raises(ValueError, match="convention= is gone"):
        VaSE(budget=960, convention="text")
    with pytest.raises(ValueError, match="must exceed the window"):
        RKV(budget=8, buffer=8)


# ---------------------------------------------------------------- through generate


@pytest.mark.parametrize("name, protect", [
    ("snapkv-paper", "none"), ("rkv-official", "none"), ("vase", "prompt")])
def test_generate_bounds_the_buffer(tiny_model, name, protect):
    T, r, new = 24, 8, 80
    policy = dataclasses.replace(POLICIES[name], budget=T, buffer=r, protect=protect)
    prompts = [np.random.default_rng(1).integers(3, 256, size=n).tolist() for n in (7, 30)]  # 30 > T
    out = randkv_jax.generate(tiny_model, prompts, policy=policy, max_new_tokens=new, chat=False,
                              ignore_eos=True, return_state=True)
    buffer = out.state.buffer
    held = np.asarray(buffer.slots_held())
    for row, (p, stats) in enumerate(zip(prompts, out.stats)):
        n = int(buffer.generated[row])
        fill, peak, rounds, _ = simulate_fill(policy, len(p), n)
        assert stats.new_tokens == new and rounds > 0
        assert stats.evictions == rounds and stats.held_after_round == T  # every round ends at exactly T
        assert stats.peak_slots == peak <= max(len(p), T) + r
        assert int(buffer.fill[row]) == fill and (held[:, row] == fill).all()
        positions = np.asarray(buffer.positions)[:, row].reshape(-1, buffer.capacity)
        newest = set(range(len(p) + n - r, len(p) + n))
        assert all(newest <= set(pos.tolist()) for pos in positions)  # the window is held
        if protect == "prompt":  # min(P, K_sel - 1) pinned prompt entries
            pinned = set(range(min(len(p), T - r - 1)))
            assert all(pinned <= set(pos.tolist()) for pos in positions)
    assert out.state.observations.queries.shape[3] == policy.needs.query_window


def test_gumbel_noise_is_finite_and_exact_at_the_extreme_draws():
    """u = (draw // 2 + 1/2) / 2^23 is exact in float32: the largest draw gives u = 1 - 2^-24, not
    1.0 (which `(draw + 1/2) / 2^24` rounds to, making the noise +inf and tying the large set)."""
    from randkv_jax.kernels.hash_prng import open_uniform

    draws = np.array([0, 1, 2**23 - 1, 2**23, 2**24 - 2, 2**24 - 1], np.uint32)
    u = np.asarray(open_uniform(jnp.asarray(draws)))
    np.testing.assert_array_equal(u.astype(np.float64), (draws.astype(np.int64) // 2 + 0.5) / 2**23)
    assert (u > 0).all() and (u < 1).all() and u[-1] == 1 - 2**-24
    noise = np.asarray(gumbel(jnp.asarray(draws)))
    assert np.isfinite(noise).all()
    np.testing.assert_allclose(noise, np_gumbel(draws), rtol=1e-6)
