"""SnapKV, R-KV and VaSE against straightforward NumPy versions of their published rules.

The references below loop over rows, heads and slots in float64 and read the formulas as written
in the sources (engine `kvcompress/engine/cache_utils.py`, R-KV `rkv/utils.py`, VaSE
`cache_utils.py`): softmax over the candidate list, torch's zero-padded avg_pool1d and
max_pool1d, R-KV's threshold rule on the dense candidate list, VaSE's two-stage selection. They
are compared on random tensors with GQA groups, holes in the candidates, pooling edges and ties,
then each policy runs through `generate` on a tiny model.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import randkv_jax
from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.hash_prng import eviction_draws
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.base import select_top
from randkv_jax.policies.rkv import RKV, RKV_PRESETS, rkv_scores
from randkv_jax.policies.snapkv import SnapKV, snapkv_scores
from randkv_jax.policies.vase import VaSE, gumbel, vase_scores
from tests.hf_tiny import save_tiny

# jitted once per static configuration and shape (compiling dominates the run time on CPU)
snapkv_jit = jax.jit(snapkv_scores, static_argnames=("kernel", "pool", "group"))
rkv_jit = jax.jit(rkv_scores, static_argnums=3)
vase_jit = jax.jit(vase_scores)
select_top_jit = jax.jit(select_top)
keep_mask_jit = jax.jit(lambda policy, *args: policy.keep_mask(*args), static_argnums=0)

# ---------------------------------------------------------------- NumPy references (float64)


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_pool(x, kernel, mode):
    """torch avg_pool1d / max_pool1d, stride 1, padding kernel // 2 (avg counts the zero padding)."""
    out = np.zeros_like(x)
    for j in range(len(x)):
        window = [x[t] for t in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= t < len(x)]
        out[j] = sum(window) / kernel if mode == "avg" else max(window)
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
        out[row, kv, idx] = np_softmax(sim.mean(axis=0))
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
    pinned), then kept - n_large Gumbel-top-k draws proportional to the SnapKV "paper" score."""
    attention = np_snapkv(q, keys, cand, "paper")
    b, k, s = positions.shape
    keep = np.zeros((b, k, s), bool)
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
    return keep


def np_gumbel(draws):
    u = (np.asarray(draws, np.float64) + 0.5) / 2**24
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
    ours = np.asarray(select_top_jit(priority[None], jnp.asarray(eligible)[None], jnp.asarray(kept))[0])
    expected = np_vase_keep(q, keys, values, positions, cand, eligible, n_large, kept, noise)
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
    draws = eviction_draws(0, jnp.arange(n_rows)[:, None, None], 0, 0, 3, jnp.arange(s)[None, None])
    priority = vase_jit(rep(q, jnp.float32), rep(keys, jnp.float32), rep(values, jnp.float32),
                        rep(positions, jnp.int32), rep(cand, bool), rep(cand, bool),
                        jnp.ones(n_rows, jnp.int32), gumbel(draws))
    kept = np.asarray(select_top_jit(priority[None], rep(cand, bool)[None], jnp.full(n_rows, 1 + n_draws))[0, :, 0])
    assert kept[:, 3].all()
    frequency = np.where(np.arange(s) == 3, 0.0, kept.mean(axis=0))
    np.testing.assert_allclose(frequency, exact, atol=0.03)
    if n_draws == 4:
        assert (exact[4:] > 0.95).all() and (frequency[4:] > 0.93).all()


# ---------------------------------------------------------------- keep masks of whole buffers


def _buffer(rng, policy, prompt_lens, held, n_generated, l=2, k=2, g=2, d=8, ties=False):
    """A buffer mid-generation: per (layer, head) a sorted random subset of the history before the
    window (`held` entries per row), then the r-token window, then empty slots."""
    r, b = policy.buffer, len(prompt_lens)
    s = max(held) + r + 3
    positions = np.full((l, b, k, s), -1)
    for li, row, kv in itertools.product(range(l), range(b), range(k)):
        start = prompt_lens[row] + n_generated - r
        history = np.sort(rng.choice(np.arange(2, start), held[row] - 2, replace=False))
        positions[li, row, kv, : held[row] + r] = np.concatenate([[0, 1], history, np.arange(start, start + r)])
    keys = rng.normal(size=(l, b, k, s, d))
    values = rng.normal(size=(l, b, k, s, d))
    if ties:  # one key and one value row per head: equal scores and equal value ranges
        keys = np.broadcast_to(keys[:, :, :, :1], keys.shape).copy()
        values = np.broadcast_to(values[:, :, :, :1], values.shape).copy()
    buffer = KVBuffer(
        keys=jnp.asarray(keys, jnp.float32), values=jnp.asarray(values, jnp.float32),
        positions=jnp.asarray(positions, jnp.int32), prompt_lens=jnp.asarray(prompt_lens, jnp.int32),
        fill=jnp.asarray([h + r for h in held], jnp.int32),
    )
    queries = rng.normal(size=(l, b, k * g, policy.needs.query_window, d))
    return buffer, Observations(queries=jnp.asarray(queries, jnp.float32)), queries


def _np_masks(policy, buffer, n_generated):
    """(protected, candidates, eligible, due) read from the policy's description."""
    pos, prompt = np.asarray(buffer.positions), np.asarray(buffer.prompt_lens)[None, :, None, None]
    valid = pos >= 0
    window = valid & (pos >= prompt + n_generated - policy.buffer)
    if policy.protect == "prompt":
        kept_prompt = pos < prompt
    elif policy.protect == "none":
        kept_prompt = np.zeros_like(valid)
    else:
        kept_prompt = pos < np.minimum(int(policy.protect.split(":")[1]), prompt)
    protected = valid & (kept_prompt | window)
    candidates = valid & ~window
    eligible = valid & ~protected
    due = (n_generated % policy.buffer == 0) & (eligible[0, :, 0].sum(-1) > policy.budget)
    return protected, candidates, eligible, due


def _np_keep(policy, buffer, queries, n_generated, row_seeds):
    protected, candidates, eligible, due = _np_masks(policy, buffer, n_generated)
    keys, values = np.asarray(buffer.keys, np.float64), np.asarray(buffer.values, np.float64)
    pos = np.asarray(buffer.positions)
    l, b, k, s = pos.shape
    keep = protected.copy()
    kept = np.full(b, policy.budget)
    for li in range(l):
        if isinstance(policy, VaSE):
            n_large = np.minimum((kept + policy.buffer) // 4 if policy.preset == "paper" else 256, kept)
            noise = np_gumbel(eviction_draws(policy.seed, jnp.asarray(row_seeds)[:, None, None], li,
                                             jnp.arange(k)[None, :, None], n_generated // policy.buffer,
                                             jnp.arange(s)[None, None]))
            keep[li] |= np_vase_keep(queries[li], keys[li], values[li], pos[li], candidates[li], eligible[li],
                                     n_large, kept, noise)
            continue
        if isinstance(policy, SnapKV):
            scores = np_snapkv(queries[li], keys[li], candidates[li], policy.preset)
        else:
            scores = np_rkv(queries[li], keys[li], candidates[li], policy.preset)
        for row, kv in itertools.product(range(b), range(k)):
            keep[li, row, kv, np_top(scores[row, kv], eligible[li, row, kv], kept[row])] = True
    return np.where(due[None, :, None, None], keep, pos >= 0)


POLICIES = {
    "snapkv-paper": SnapKV(budget=6, buffer=8),
    "snapkv-rkv-repo": SnapKV(budget=6, buffer=8, preset="rkv-repo"),
    "rkv-paper": RKV(budget=6, buffer=8),
    "rkv-official": RKV(budget=6, buffer=8, preset="official"),
    "vase-paper": VaSE(budget=6, buffer=8),
    "vase-original": VaSE(budget=6, buffer=8, preset="original", seed=3),
}


# every policy in its default regime (protect "none"), the other protections on a few (compiles cost)
KEEP_CASES = [(name, "none") for name in sorted(POLICIES)] + [
    ("snapkv-paper", "prompt"), ("rkv-paper", "prompt"), ("vase-paper", "prompt"), ("vase-paper", "sinks:3")]


@pytest.mark.parametrize("name, protect", KEEP_CASES)
def test_keep_mask_equals_numpy(name, protect):
    policy = dataclasses.replace(POLICIES[name], protect=protect)
    rng = np.random.default_rng(sorted(POLICIES).index(name) * 10 + len(protect))
    n_generated, row_seeds = 24, np.array([7, 8, 9])
    # row 2 has too few eligible entries: not due, keeps everything
    for ties in (False, True):
        buffer, obs, queries = _buffer(rng, policy, [6, 3, 4], [17, 14, 6], n_generated, ties=ties)
        ours = keep_mask_jit(policy, buffer, jnp.int32(n_generated), jnp.asarray(row_seeds), obs)
        expected = _np_keep(policy, buffer, queries, n_generated, row_seeds)
        np.testing.assert_array_equal(np.asarray(ours), expected)
        held = np.asarray(ours).sum(-1)
        protected = _np_masks(policy, buffer, n_generated)[0].sum(-1)
        assert (held[:, :2] == protected[:, :2] + policy.budget).all() and (held[:, 2] == 6 + 8).all()


def test_vase_draws_depend_on_seeds_only():
    policy = POLICIES["vase-paper"]
    rng = np.random.default_rng(0)
    buffer, obs, _ = _buffer(rng, policy, [6, 3, 4], [17, 14, 12], 24)
    mask = lambda p, seeds: np.asarray(keep_mask_jit(p, buffer, jnp.int32(24), jnp.asarray(seeds), obs))  # noqa: E731
    a = mask(policy, [7, 8, 9])
    np.testing.assert_array_equal(a, mask(policy, [7, 8, 9]))
    assert not np.array_equal(a, mask(policy, [17, 18, 19]))
    assert not np.array_equal(a, mask(dataclasses.replace(policy, seed=1), [7, 8, 9]))


def test_presets_needs_and_validation():
    assert SnapKV().needs == ScoringNeeds(query_window=64) and SnapKV().protect == "none"
    assert SnapKV(preset="rkv-repo").needs == ScoringNeeds(query_window=8)
    assert RKV(buffer=32).needs == ScoringNeeds(query_window=32)
    assert RKV(preset="official").needs == ScoringNeeds(query_window=8)
    assert VaSE(buffer=16).needs == ScoringNeeds(query_window=16) and VaSE().protect == "none"
    assert RKV_PRESETS["paper"].mix_lambda == 0.5 and RKV_PRESETS["official"].mix_lambda == 0.1
    lens = jnp.asarray([5, 500])
    np.testing.assert_array_equal(VaSE(budget=960, convention="text").n_large(lens), [256, 256])
    np.testing.assert_array_equal(VaSE(budget=1024, convention="engine").n_large(lens), [256, 256])
    np.testing.assert_array_equal(VaSE(budget=4096, convention="engine", preset="original").n_large(lens), [256, 256])
    np.testing.assert_array_equal(VaSE(budget=100, preset="original").n_large(lens), [100, 100])
    with pytest.raises(ValueError, match="preset must be one of"):
        SnapKV(preset="max")
    with pytest.raises(ValueError, match="query window 8 exceeds buffer"):
        RKV(buffer=4, preset="official")
    with pytest.raises(ValueError, match="preset must be one of"):
        VaSE(preset="k/4")


# ---------------------------------------------------------------- through generate


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_untied")
    save_tiny("qwen3_untied", directory, seed=3)
    return randkv_jax.load_model(directory, dtype="float32")


@pytest.mark.parametrize("name, protect", [
    ("snapkv-paper", "none"), ("rkv-official", "none"), ("vase-paper", "prompt")])
def test_generate_bounds_the_buffer(tiny_model, name, protect):
    K, r, new = 16, 8, 80
    policy = dataclasses.replace(POLICIES[name], budget=K, buffer=r, protect=protect)
    prompts = [np.random.default_rng(1).integers(3, 256, size=n).tolist() for n in (7, 19)]
    out = randkv_jax.generate(tiny_model, prompts, policy=policy, max_new_tokens=new, chat=False,
                              ignore_eos=True, return_state=True)
    held = np.asarray(out.state.buffer.slots_held())
    for row, (p, stats) in enumerate(zip(prompts, out.stats)):
        assert stats.new_tokens == new and stats.evictions > 0
        assert stats.peak_slots <= len(p) + K + 2 * r
        assert (held[:, row] <= len(p) + K + 2 * r).all()
        if protect == "prompt":
            positions = np.asarray(out.state.buffer.positions)[:, row]
            assert all(set(range(len(p))) <= set(pos.tolist()) for pos in positions.reshape(-1, positions.shape[-1]))
    assert out.state.observations.queries.shape[3] == policy.needs.query_window
