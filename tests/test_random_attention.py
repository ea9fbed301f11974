"""Random Attention's eviction rounds on a simulated buffer: invariants and statistics.

No model is needed: a step appends one generated entry per row (as the decode loop does) and a
round runs whenever the policy says a row is due. The checks are the paper's rule read literally.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from randkv_jax import policies
from randkv_jax.buffer import KVBuffer, compact
from randkv_jax.models.config import ModelConfig, RopeConfig
from randkv_jax.policies import RandomAttention


def _config(layers=2, kv_heads=4):
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=16, hidden_size=8, intermediate_size=8,
        num_layers=layers, num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=2, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1e4), max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=False,
    )


def _prefilled(prompt_lens, policy, steps, layers=2, kv_heads=4) -> KVBuffer:
    capacity = max(prompt_lens) + policy.capacity(0, steps)
    buf = KVBuffer.empty(_config(layers, kv_heads), len(prompt_lens), capacity, jnp.float32)
    lens = jnp.asarray(prompt_lens, jnp.int32)
    pos = jnp.where(jnp.arange(capacity)[None] < lens[:, None], jnp.arange(capacity)[None], -1)
    positions = jnp.broadcast_to(pos[None, :, None, :], buf.positions.shape).astype(jnp.int32)
    return dataclasses.replace(buf, positions=positions, prompt_lens=lens, fill=lens)


@jax.jit
def _append(buf: KVBuffer, step):
    """Append generated token number `step` (0-based) at each row's fill slot."""
    rows = jnp.arange(buf.fill.shape[0])
    # advanced indices (rows, fill) split by a slice: the indexed shape is [b, l, k]
    positions = buf.positions.at[:, rows, :, buf.fill].set((buf.prompt_lens + step)[:, None, None])
    return dataclasses.replace(buf, positions=positions, fill=buf.fill + 1)


@functools.partial(jax.jit, static_argnums=0)
def _round(policy, buf, n_generated, row_seeds):
    return compact(buf, policy.keep_mask(buf, n_generated, row_seeds))


def simulate(policy, prompt_lens, steps, row_seeds, layers=2, kv_heads=4, on_round=None):
    """Run `steps` generated tokens; call on_round(before, after, n_generated) after each round."""
    buf = _prefilled(prompt_lens, policy, steps, layers, kv_heads)
    seeds = jnp.asarray(row_seeds, jnp.int32)
    for step in range(steps):
        buf = _append(buf, step)
        n = jnp.int32(step + 1)
        if bool(jnp.any(policy.due(buf, n))):
            after = _round(policy, buf, n, seeds)
            if on_round is not None:
                on_round(buf, after, step + 1)
            buf = after
    return buf


def _held(buf):
    return np.asarray(buf.slots_held())  # [l, b, k]


def test_round_invariants():
    K, r, prompt_lens = 24, 8, [5, 11, 3]
    policy = RandomAttention(budget=K, buffer=r)
    rounds = []

    def check(before, after, n):
        rounds.append(n)
        pos_after = np.asarray(after.positions)
        for b, p in enumerate(prompt_lens):
            eligible = _held(before)[0, b, 0] - p - r  # generated entries outside the window
            assert (_held(after)[:, b] == p + min(K, eligible) + r).all()
            for l in range(pos_after.shape[0]):
                for h in range(pos_after.shape[2]):
                    held = pos_after[l, b, h][pos_after[l, b, h] >= 0]
                    assert np.all(np.diff(held) > 0), "kept entries must stay in chronological order"
                    assert set(range(p)) <= set(held.tolist()), "every prompt slot survives"
                    assert set(range(p + n - r, p + n)) <= set(held.tolist()), "the window survives"
                    assert (pos_after[l, b, h][len(held):] == -1).all()
        # heads and layers keep different sets
        gen = pos_after[:, 0]
        assert len({tuple(gen[l, h]) for l in range(gen.shape[0]) for h in range(gen.shape[1])}) > 1

    final = simulate(policy, prompt_lens, 200, [1, 2, 3], on_round=check)
    assert rounds == [40 + 8 * i for i in range(21)]  # first when K + r eligible ... every r after
    for b, p in enumerate(prompt_lens):
        assert _held(final)[:, b].max() <= p + K + 2 * r


def test_peak_never_exceeds_prompt_plus_k_plus_2r():
    for K, r in [(10, 4), (16, 16), (7, 5)]:
        policy = RandomAttention(budget=K, buffer=r)
        peaks = []
        simulate(policy, [4, 9], 120, [0, 1], on_round=lambda before, after, n: peaks.append(_held(before)))
        assert peaks
        for held in peaks:
            assert (held[:, 0] <= 4 + K + 2 * r).all() and (held[:, 1] <= 9 + K + 2 * r).all()


def test_k_larger_than_eligible_keeps_everything():
    policy = RandomAttention(budget=100, buffer=8)
    final = simulate(policy, [6], 64, [0])
    assert (_held(final) == 6 + 64).all()


def test_same_seeds_rerun_bit_identical_and_other_seeds_differ():
    policy = RandomAttention(budget=16, buffer=8)
    a = simulate(policy, [5, 7], 96, [11, 12])
    b = simulate(policy, [5, 7], 96, [11, 12])
    c = simulate(policy, [5, 7], 96, [13, 14])
    np.testing.assert_array_equal(np.asarray(a.positions), np.asarray(b.positions))
    assert not np.array_equal(np.asarray(a.positions), np.asarray(c.positions))
    d = simulate(dataclasses.replace(policy, seed=1), [5, 7], 96, [11, 12])
    assert not np.array_equal(np.asarray(a.positions), np.asarray(d.positions))


def test_keep_sets_do_not_depend_on_batch_position_or_size():
    policy = RandomAttention(budget=16, buffer=8)
    batch = simulate(policy, [5, 9, 7], 100, [21, 22, 23])
    alone = simulate(policy, [9], 100, [22])
    swapped = simulate(policy, [7, 9], 100, [23, 22])
    row = np.asarray(batch.positions)[:, 1]
    np.testing.assert_array_equal(row[..., : int(batch.fill[1])], np.asarray(alone.positions)[:, 0, :, : int(alone.fill[0])])
    np.testing.assert_array_equal(row[..., : int(batch.fill[1])], np.asarray(swapped.positions)[:, 1, :, : int(swapped.fill[1])])


def test_survival_over_rounds_follows_k_over_k_plus_r():
    """A generated token that has faced n rounds as a candidate survives with (K/(K+r))^n."""
    K, r, layers, heads, rows = 32, 16, 4, 8, 8
    policy = RandomAttention(budget=K, buffer=r)
    first_round = K + 2 * r  # K a multiple of r: every round sees exactly K + r candidates
    steps = first_round + 4 * r
    final = simulate(policy, [4] * rows, steps, list(range(rows)), layers, heads)
    held = np.asarray(final.positions) - 4  # generated index of each kept entry
    p_keep = K / (K + r)
    for n in range(1, 5):
        # tokens that were candidates in exactly the last n rounds: they left the window n rounds ago
        last_round = steps
        newest_candidate = last_round - r - (n - 1) * r  # exclusive upper bound of that cohort
        cohort = range(newest_candidate - r, newest_candidate)
        survived = sum(int(np.isin(held[l, b, h], cohort).sum())
                       for l in range(layers) for b in range(rows) for h in range(heads))
        trials = len(cohort) * layers * rows * heads
        test = stats.binomtest(survived, trials, p_keep**n)
        assert test.pvalue > 1e-3, (n, survived / trials, p_keep**n)


def test_inclusion_is_uniform_over_candidates():
    """Each candidate slot is kept with probability K/(K+r) at a steady-state round (chi-square)."""
    K, r = 24, 8
    policy = RandomAttention(budget=K, buffer=r)
    counts = np.zeros(K + r)
    for seed in range(30):
        def tally(before, after, n):
            if n == K + 2 * r:  # first round: candidates are generated tokens 0 .. K + r - 1
                kept = np.asarray(after.positions) - 2
                for i in range(K + r):
                    counts[i] += (kept == i).sum()
        simulate(dataclasses.replace(policy, seed=seed), [2], K + 2 * r, [seed], 2, 4, tally)
    trials = 30 * 2 * 4
    expected = np.full(K + r, trials * K / (K + r))
    # each slot's count is binomial(trials, K/(K+r)); the sum is fixed, so chi-square on K+r-1 dof
    chi2 = ((counts - expected) ** 2 / (expected * (1 - K / (K + r)))).sum()
    assert stats.chi2.sf(chi2, K + r - 1) > 1e-3


def test_shared_across_heads_and_block_controls():
    shared = simulate(RandomAttention(budget=16, buffer=8, shared_across_heads=True), [4], 80, [5])
    pos = np.asarray(shared.positions)
    assert all(np.array_equal(pos[0, 0, 0], pos[0, 0, h]) for h in range(pos.shape[2]))
    assert not np.array_equal(pos[0, 0, 0], pos[1, 0, 0])  # layers still draw independently

    blocks = RandomAttention(budget=16, buffer=8, block_size=4)
    def runs(before, after, n):
        # before the round slots were contiguous positions; kept candidates come in aligned blocks of 4
        kept = np.asarray(after.positions)[..., :]
        for l in range(kept.shape[0]):
            for h in range(kept.shape[2]):
                gen = kept[l, 0, h][(kept[l, 0, h] >= 4) & (kept[l, 0, h] < 4 + n - 8)]
                slots = np.searchsorted(np.asarray(before.positions)[l, 0, h], gen)
                assert len(set((slots // 4).tolist())) == len(gen) // 4
    simulate(blocks, [4], 40, [5], on_round=runs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=0), "budget must be a positive"),
    (dict(budget=-3), "budget must be a positive"),
    (dict(buffer=0), "buffer must be a positive"),
    (dict(protect="sinks:x"), "protect must be"),
    (dict(block_size=0), "block_size"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RandomAttention(**kwargs)


def test_registry():
    assert {"full", "random"} <= set(policies.available())
    assert policies.get("random", budget=8) == RandomAttention(budget=8)
    with pytest.raises(ValueError, match="unknown policy 'snap'; available: .*random"):
        policies.get("snap")


def test_budget_conventions():
    assert RandomAttention(budget=1024, buffer=64, convention="engine").max_kept == 960
    assert RandomAttention(budget=1024, buffer=64, convention="text").max_kept == 1024
    vllm = RandomAttention(budget=2048, buffer=128, convention="vllm")
    np.testing.assert_array_equal(vllm.kept_per_row(jnp.asarray([1000, 1900, 3000])), [920, 20, 0])


def test_protect_none_and_sinks():
    K, r = 12, 4
    for protect, kept_prompt in (("none", 0), ("sinks:3", 3)):
        policy = RandomAttention(budget=K, buffer=r, protect=protect)
        final = simulate(policy, [10], 80, [1])
        pos = np.asarray(final.positions)
        assert (_held(final) == kept_prompt + K + r).all() or (_held(final) <= kept_prompt + K + 2 * r).all()
        for l in range(pos.shape[0]):
            for h in range(pos.shape[2]):
                assert set(range(kept_prompt)) <= set(pos[l, 0, h].tolist())
        # the unprotected part of the prompt is evicted somewhere
        assert not all(set(range(10)) <= set(pos[l, 0, h].tolist()) for l in range(2) for h in range(4))


def test_select_top_keeps_k_even_when_eligible_scores_are_minus_inf():
    from randkv_jax.policies.base import select_top

    scores = jnp.asarray([[[[-jnp.inf, 0.5, -jnp.inf, -jnp.inf, 2.0, -jnp.inf]]]])
    eligible = jnp.asarray([[[[False, True, True, True, True, False]]]])
    keep = np.asarray(select_top(scores, eligible, jnp.asarray([3])))[0, 0, 0]
    np.testing.assert_array_equal(keep, [False, True, True, False, True, False])  # -inf tie -> lower slot
