"""Random Attention's eviction rounds on a simulated buffer: the budget rule and its statistics.

No model is needed: a step appends one generated entry per row (as the decode loop does) and a
round runs whenever the policy says a row is due. The checks are the paper's engine rule read
literally (`../shared/reference/algorithms.md` §1.2-1.3): after a round every (layer, row, KV
head) holds exactly T = budget entries, the pinned prompt (min(P, K_sel - 1) entries) and the
w-token window among them.
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
    capacity = max(policy.capacity(p, steps) for p in prompt_lens)
    buf = KVBuffer.empty(_config(layers, kv_heads), len(prompt_lens), capacity, jnp.float32)
    lens = jnp.asarray(prompt_lens, jnp.int32)
    pos = jnp.where(jnp.arange(capacity)[None] < lens[:, None], jnp.arange(capacity)[None], -1)
    positions = jnp.broadcast_to(pos[None, :, None, :], buf.positions.shape).astype(jnp.int32)
    return dataclasses.replace(buf, positions=positions, prompt_lens=lens, fill=lens)


@jax.jit
def _append(buf: KVBuffer):
    """Append each row's next generated token at its fill slot."""
    rows = jnp.arange(buf.fill.shape[0])
    # advanced indices (rows, fill) split by a slice: the indexed shape is [b, l, k]
    positions = buf.positions.at[:, rows, :, buf.fill].set((buf.prompt_lens + buf.generated)[:, None, None])
    return dataclasses.replace(buf, positions=positions, fill=buf.fill + 1, generated=buf.generated + 1)


@functools.partial(jax.jit, static_argnums=0)
def _round(policy, buf, row_seeds):
    return compact(buf, policy.keep_mask(buf, row_seeds, platform="cpu"))[0]


def simulate(policy, prompt_lens, steps, row_seeds, layers=2, kv_heads=4, on_round=None):
    """Run `steps` generated tokens; call on_round(before, after, due, n_generated) after each round."""
    buf = _prefilled(prompt_lens, policy, steps, layers, kv_heads)
    seeds = jnp.asarray(row_seeds, jnp.int32)
    for step in range(steps):
        buf = _append(buf)
        assert int(buf.fill.max()) <= buf.capacity
        due = np.asarray(policy.due(buf))
        if due.any():
            after = _round(policy, buf, seeds)
            if on_round is not None:
                on_round(buf, after, due, step + 1)
            buf = after
    return buf


def _held(buf):
    return np.asarray(buf.slots_held())  # [l, b, k]


def test_round_invariants():
    T, w, prompt_lens = 32, 8, [5, 11, 3, 40]  # K_sel = 24; the last prompt is longer than K_sel
    policy = RandomAttention(budget=T, buffer=w)
    rounds = {b: [] for b in range(len(prompt_lens))}

    def check(before, after, due, n):
        pos_after = np.asarray(after.positions)
        for b, p in enumerate(prompt_lens):
            if not due[b]:
                np.testing.assert_array_equal(pos_after[:, b], np.asarray(before.positions)[:, b])
                continue
            rounds[b].append(n)
            assert _held(before)[0, b, 0] > T
            assert (_held(after)[:, b] == T).all(), "every (layer, head) of a due row holds exactly T"
            pinned = range(min(p, T - w - 1))
            for l in range(pos_after.shape[0]):
                for h in range(pos_after.shape[2]):
                    held = pos_after[l, b, h][pos_after[l, b, h] >= 0]
                    assert np.all(np.diff(held) > 0), "kept entries must stay in chronological order"
                    assert set(pinned) <= set(held.tolist()), "the pinned prompt survives"
                    assert set(range(p + n - w, p + n)) <= set(held.tolist()), "the window survives"
                    assert (pos_after[l, b, h][len(held):] == -1).all()
        # heads and layers keep different sets
        gen = pos_after[:, int(np.flatnonzero(due)[0])]
        assert len({tuple(gen[l, h]) for l in range(gen.shape[0]) for h in range(gen.shape[1])}) > 1

    final = simulate(policy, prompt_lens, 200, [1, 2, 3, 4], on_round=check)
    for b, p in enumerate(prompt_lens):
        first = next(g for g in range(w, 201, w) if p + g > T)  # first multiple of i past the budget
        assert rounds[b] == list(range(first, 201, w)), (b, rounds[b])
        assert _held(final)[:, b].max() <= max(p, T) + w
    # the long prompt's tail competed: some head lost prompt positions >= K_sel - 1
    pos = np.asarray(final.positions)[:, 3]
    assert any(not set(range(40)) <= set(pos[l, h].tolist()) for l in range(2) for h in range(4))


def test_peak_never_exceeds_max_of_prompt_and_budget_plus_interval():
    for T, w, i, prompt_lens in [(14, 4, 4, [4, 9, 30]), (32, 16, 16, [3, 50]), (12, 5, 3, [7, 1])]:
        policy = RandomAttention(budget=T, window=w, interval=i)
        peaks = []
        simulate(policy, prompt_lens, 120, [0, 1, 2][: len(prompt_lens)],
                 on_round=lambda before, after, due, n: peaks.append(_held(before)))
        assert peaks
        for held in peaks:
            for b, p in enumerate(prompt_lens):
                assert (held[:, b] <= max(p, T) + i).all()
        for b, p in enumerate(prompt_lens):  # the capacity is exactly that bound (or the whole run)
            assert policy.capacity(p, 120) == min(p + 120, max(p, T) + i)


def test_budget_larger_than_the_sequence_keeps_everything():
    policy = RandomAttention(budget=100, buffer=8)
    final = simulate(policy, [6], 64, [0])
    assert (_held(final) == 6 + 64).all()


def test_same_seeds_rerun_bit_identical_and_other_seeds_differ():
    policy = RandomAttention(budget=24, buffer=8)
    a = simulate(policy, [5, 7], 96, [11, 12])
    b = simulate(policy, [5, 7], 96, [11, 12])
    c = simulate(policy, [5, 7], 96, [13, 14])
    np.testing.assert_array_equal(np.asarray(a.positions), np.asarray(b.positions))
    assert not np.array_equal(np.asarray(a.positions), np.asarray(c.positions))
    d = simulate(dataclasses.replace(policy, seed=1), [5, 7], 96, [11, 12])
    assert not np.array_equal(np.asarray(a.positions), np.asarray(d.positions))


def test_keep_sets_do_not_depend_on_batch_position_or_size():
    policy = RandomAttention(budget=24, buffer=8)
    batch = simulate(policy, [5, 9, 7], 100, [21, 22, 23])
    alone = simulate(policy, [9], 100, [22])
    swapped = simulate(policy, [7, 9], 100, [23, 22])
    row = np.asarray(batch.positions)[:, 1]
    fill = int(batch.fill[1])
    np.testing.assert_array_equal(row[..., :fill], np.asarray(alone.positions)[:, 0, :, :fill])
    np.testing.assert_array_equal(row[..., :fill], np.asarray(swapped.positions)[:, 1, :, :fill])


def _survival(policy, prompt_lens, steps, layers, heads, max_rounds):
    """Per row and n: (survivors, trials) of generated tokens that faced exactly n steady-state rounds
    as eligible entries (held T + i before each), read off the buffer after the last round."""
    rounds = []  # (n_generated, due per row, steady per row)

    def record(before, after, due, n):
        rounds.append((n, due, _held(before)[0, :, 0] == policy.budget + policy.interval))

    final = simulate(policy, prompt_lens, steps, list(range(len(prompt_lens))), layers, heads, on_round=record)
    assert rounds[-1][0] == steps, "the run must end on a round"
    held = np.asarray(final.positions)
    out = {}
    for b, p in enumerate(prompt_lens):
        # generated index j -> steadiness of each round that saw it eligible (outside the window)
        faced = {j: [steady[b] for g, due, steady in rounds if due[b] and j < g - policy.window] for j in range(steps)}
        for n in range(1, max_rounds + 1):
            cohort = [p + j for j, f in faced.items() if len(f) == n and all(f)]
            survived = sum(int(np.isin(held[l, b, h], cohort).sum()) for l in range(layers) for h in range(heads))
            out[b, n] = (survived, len(cohort) * layers * heads)
    return out


def test_survival_per_round_follows_the_budget_rule_with_each_rows_prompt():
    """A generated token survives a steady-state round with p = (K_sel - l_p) / (K_sel - l_p + i),
    l_p being its own row's pinned prompt: the prompt counts inside the budget. The same data
    reject the old rule's K / (K + r) (prompt on top of the budget)."""
    k_sel, i, layers, heads = 64, 16, 4, 8
    policy = RandomAttention(budget=k_sel + i, buffer=i)  # w = i = 16
    prompt_lens = [32, 48]  # p = 0.667 and 0.5 where the old rule says 0.8
    counts = _survival(policy, prompt_lens, steps=16 * 12, layers=layers, heads=heads, max_rounds=3)
    for b, l_p in enumerate(prompt_lens):
        p_new = (k_sel - l_p) / (k_sel - l_p + i)
        for n in (1, 2, 3):
            survived, trials = counts[b, n]
            assert trials >= 16 * layers * heads
            assert stats.binomtest(survived, trials, p_new**n).pvalue > 1e-3, (b, n, survived / trials, p_new**n)
        survived, trials = counts[b, 1]
        assert stats.binomtest(survived, trials, k_sel / (k_sel + i)).pvalue < 1e-6  # the old rule's 0.8


def test_inclusion_is_uniform_over_eligible_entries():
    """At a round each eligible entry is kept with probability (K_sel - l_p) / eligible (chi-square)."""
    T, w, p = 32, 8, 2  # K_sel 24, pinned 2 -> 22 of the eligible entries kept
    policy = RandomAttention(budget=T, buffer=w)
    first = next(g for g in range(w, 200, w) if p + g > T)  # 32: held 34 -> 24 eligible (generated 0 .. 23)
    eligible = p + first - w - p
    n_keep = T - w - p
    counts = np.zeros(eligible)
    for seed in range(30):
        def tally(before, after, due, n):
            if n == first:
                kept = np.asarray(after.positions) - p
                for j in range(eligible):
                    counts[j] += (kept == j).sum()
        simulate(dataclasses.replace(policy, seed=seed), [p], first, [seed], 2, 4, tally)
    trials = 30 * 2 * 4
    q = n_keep / eligible
    expected = np.full(eligible, trials * q)
    assert counts.sum() == trials * n_keep
    # each count is binomial(trials, q) with a fixed total: chi-square on eligible - 1 dof
    chi2 = ((counts - expected) ** 2 / (expected * (1 - q))).sum()
    assert stats.chi2.sf(chi2, eligible - 1) > 1e-3


def test_shared_across_heads_and_slots_per_draw_controls():
    shared = simulate(RandomAttention(budget=24, buffer=8, shared_across_heads=True), [4], 80, [5])
    pos = np.asarray(shared.positions)
    assert all(np.array_equal(pos[0, 0, 0], pos[0, 0, h]) for h in range(pos.shape[2]))
    assert not np.array_equal(pos[0, 0, 0], pos[1, 0, 0])  # layers still draw independently

    blocks = RandomAttention(budget=24, buffer=8, slots_per_draw=4)

    def runs(before, after, due, n):
        # before the round slots held contiguous positions; eligible entries are kept in whole
        # aligned blocks of 4 slots, but for the one block that completes the count
        kept = np.asarray(after.positions)
        for l in range(kept.shape[0]):
            for h in range(kept.shape[2]):
                gen = kept[l, 0, h][(kept[l, 0, h] >= 4) & (kept[l, 0, h] < 4 + n - 8)]
                slots = np.searchsorted(np.asarray(before.positions)[l, 0, h], gen)
                sizes = np.bincount(slots // 4)
                assert (sizes[sizes > 0] < 4).sum() <= 2  # partial blocks: the prompt's edge, the last one
    simulate(blocks, [4], 40, [5], on_round=runs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=0), "budget must be a positive"),
    (dict(budget=-3), "budget must be a positive"),
    (dict(buffer=0), "window must be a positive"),
    (dict(window=8, interval=0), "interval must be a positive"),
    (dict(budget=64, buffer=64), "must exceed the window"),
    (dict(protect="sinks:x"), "protect must be"),
    (dict(slots_per_draw=0), "slots_per_draw"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RandomAttention(**kwargs)


def test_registry():
    assert {"full", "random"} <= set(policies.available())
    assert policies.get("random", budget=80) == RandomAttention(budget=80)
    with pytest.raises(ValueError, match="unknown policy 'snap'; available: .*random"):
        policies.get("snap")


def test_budget_fields_and_the_old_conventions_refused():
    p = RandomAttention(budget=1024, buffer=64)
    assert (p.window, p.interval, p.selected) == (64, 64, 960)
    assert RandomAttention(budget=2048, window=128, interval=64).rule.interval == 64  # the vLLM plugin
    assert RandomAttention(budget=1024, window=32).interval == 32
    assert RandomAttention.from_selected(1024, window=64) == RandomAttention(budget=1088, window=64)  # probes' TB
    for convention, hint in (("text", "from_selected"), ("engine", "drop convention"), ("vllm", "interval")):
        with pytest.raises(ValueError, match=f"convention= is gone.*{hint}"):
            RandomAttention(budget=1024, convention=convention)


@pytest.mark.parametrize("protect, pinned", [("none", 0), ("sinks:3", 3), ("prompt", 10), ("sinks:50", 10)])
def test_protect_regimes_pin_inside_the_budget(protect, pinned):
    T, w = 20, 4
    policy = RandomAttention(budget=T, buffer=w, protect=protect)
    final = simulate(policy, [10], 80, [1])  # 80 is a round: the buffer holds T after it
    pos = np.asarray(final.positions)
    assert (_held(final) == T).all()
    for l in range(pos.shape[0]):
        for h in range(pos.shape[2]):
            assert set(range(pinned)) <= set(pos[l, 0, h].tolist())
    if pinned < 10:  # the unpinned part of the prompt is evicted somewhere
        assert not all(set(range(10)) <= set(pos[l, 0, h].tolist()) for l in range(2) for h in range(4))


def test_prompt_longer_than_the_selection_keeps_k_sel_minus_one_pinned():
    T, w = 20, 4  # K_sel 16: positions 0 .. 14 pinned, the rest of a 30-token prompt competes
    policy = RandomAttention(budget=T, buffer=w)
    assert int(policy.rule.n_pinned(jnp.int32(30))) == 15 and int(policy.rule.n_select(jnp.int32(30))) == 1
    final = simulate(policy, [30], 8, [3])
    pos = np.asarray(final.positions)
    assert (_held(final) == T).all()
    for held in pos.reshape(-1, pos.shape[-1]):
        kept = held[held >= 0].tolist()
        assert kept[:15] == list(range(15)) and kept[-w:] == list(range(34, 38))
        assert 15 <= kept[15] < 34  # one competing entry: a prompt tail or a generated token


def test_select_top_keeps_count_even_when_eligible_scores_are_minus_inf():
    from randkv_jax.rule import select_top

    scores = jnp.asarray([[[[-jnp.inf, 0.5, -jnp.inf, -jnp.inf, 2.0, -jnp.inf]]]])
    eligible = jnp.asarray([[[[False, True, True, True, True, False]]]])
    keep = np.asarray(select_top(scores, eligible, jnp.asarray([3])[None, :, None]))[0, 0, 0]
    np.testing.assert_array_equal(keep, [False, True, True, False, True, False])  # -inf tie -> lower slot
