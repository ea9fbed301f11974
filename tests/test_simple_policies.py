"""H2O, TOVA, StreamingLLM and Recency: scores and keep-sets against NumPy, and in `generate`.

The NumPy references are the published rules read literally (loops over layers, rows, heads and
slots): H2O's accumulated attention and its top-K, TOVA's head-averaged attention of the newest
query, and the position score of Recency / StreamingLLM; the round itself follows the shared
budget rule, written here from its description (not from `randkv_jax.rule`): a due row keeps
its pinned prompt entries, its window and the best eligible entries, `budget` entries in all.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import randkv_jax
from randkv_jax.buffer import KVBuffer, compact
from randkv_jax.decode import DecodeSpec, decode_chunk, empty_state
from randkv_jax.models.decoder import Decoder, DenseInputs, causal_attend
from randkv_jax.observations import Observations, ScoringNeeds, reorder, slot_attention
from randkv_jax.policies.h2o import H2O
from randkv_jax.policies.random import RandomAttention
from randkv_jax.policies.recency import Recency, recency_scores
from randkv_jax.policies.streaming import StreamingLLM
from randkv_jax.policies.tova import TOVA, tova_scores
from randkv_jax.sampling import SamplingParams
from tests.budget_rule import simulate_fill

T, R = 14, 8  # simulated rounds: budget (window included), window = interval
K_SEL = T - R
PROMPT_LENS = [5, 9, 3, 6]  # 9 > K_SEL: under protect "prompt" its tail competes
GENERATED = [40, 40, 40, 36]  # row 3 is off the interval: not due


# ---------------------------------------------------------------- simulated buffers and references


def _buffer(rng, prompt_lens=PROMPT_LENS, layers=2, kv_heads=2, d=8, same_heads=False, holes=12):
    """A buffer mid-generation (row i has generated GENERATED[i]): the whole prompt, `holes`+row
    random older generated entries per (layer, head) (per layer when `same_heads`), the R-token
    window; 3 empty slots. Every row holds more than T entries."""
    b = len(prompt_lens)
    generated = GENERATED[:b]
    fills = [p + holes + row + R for row, p in enumerate(prompt_lens)]
    s = max(fills) + 3
    positions = np.full((layers, b, kv_heads, s), -1, np.int32)
    for l in range(layers):
        for row, (p, n) in enumerate(zip(prompt_lens, generated)):
            shared = rng.choice(np.arange(p, p + n - R), holes + row, replace=False)
            for h in range(kv_heads):
                older = shared if same_heads else rng.choice(np.arange(p, p + n - R), holes + row, replace=False)
                held = np.concatenate([np.arange(p), np.sort(older), np.arange(p + n - R, p + n)])
                positions[l, row, h, : len(held)] = held
    keys = rng.standard_normal((layers, b, kv_heads, s, d)).astype(np.float32)
    return KVBuffer(
        keys=jnp.asarray(keys), values=jnp.zeros_like(jnp.asarray(keys)), positions=jnp.asarray(positions),
        prompt_lens=jnp.asarray(prompt_lens, jnp.int32), fill=jnp.asarray(fills, jnp.int32),
        generated=jnp.asarray(generated, jnp.int32),
    )


def _n_pinned(policy, p):
    """Pinned prompt entries: min(P, N, K_sel - 1), N = P for "prompt", 0 for "none", N for "sinks:N"."""
    protect = policy.protect
    sinks = p if protect == "prompt" else 0 if protect == "none" else int(protect.removeprefix("sinks:"))
    return min(p, sinks, policy.budget - policy.window - 1)


def _due(policy, fill, generated):
    return generated > 0 and generated % policy.interval == 0 and fill > policy.budget


def _np_keep(policy, buf, scores):
    """A round of `policy` read from its description: in a due row each (layer, head) keeps its
    pinned and window entries plus the K_sel - pinned highest-scoring others (ties -> lower slot);
    other rows keep everything."""
    positions = np.asarray(buf.positions)
    keep = np.zeros(positions.shape, bool)
    for idx in np.ndindex(positions.shape[:3]):
        row = idx[1]
        p, n, fill = int(buf.prompt_lens[row]), int(buf.generated[row]), int(buf.fill[row])
        pos = positions[idx]
        valid = [t for t in range(len(pos)) if pos[t] >= 0]
        if not _due(policy, fill, n):
            keep[idx][valid] = True
            continue
        pins = _n_pinned(policy, p)
        protected = [t for t in valid if pos[t] < pins or pos[t] >= p + n - policy.window]
        eligible = [t for t in valid if t not in protected]
        chosen = sorted(eligible, key=lambda t: (-scores[idx][t], t))[: policy.budget - policy.window - pins]
        keep[idx][protected + chosen] = True
    return keep


def _keep_mask(policy, buf, observations=None):
    keep_mask = jax.jit(functools.partial(policy.keep_mask, platform="cpu"))  # one compilation, not op-by-op
    return np.asarray(keep_mask(buf, jnp.zeros(buf.fill.shape, jnp.int32), observations))


def _assert_round(policy, buf, keep):
    """Due rows hold exactly T entries per (layer, head) after the round; other rows all of theirs."""
    held = keep.sum(-1)
    for row in range(keep.shape[1]):
        due = _due(policy, int(buf.fill[row]), int(buf.generated[row]))
        assert (held[:, row] == (policy.budget if due else int(buf.fill[row]))).all()


def _np_softmax(logits):
    e = np.exp(logits - logits.max())
    return e / e.sum()


# ---------------------------------------------------------------- Recency and StreamingLLM


@pytest.mark.parametrize("policy", [Recency(budget=T, buffer=R), StreamingLLM(budget=T, buffer=R),
                                    Recency(budget=T, buffer=R, protect="prompt"),
                                    StreamingLLM(budget=T, buffer=R, protect="sinks:2")])
def test_position_scores_and_keep_sets_equal_numpy(policy):
    rng = np.random.default_rng(0)
    buf = _buffer(rng)
    positions = np.asarray(buf.positions)
    np.testing.assert_array_equal(np.asarray(recency_scores(buf.positions)), positions.astype(np.float32))
    expected = _np_keep(policy, buf, positions)
    keep = _keep_mask(policy, buf)
    np.testing.assert_array_equal(keep, expected)
    _assert_round(policy, buf, keep)
    for idx in np.ndindex(positions.shape[:3]):
        p, n = PROMPT_LENS[idx[1]], GENERATED[idx[1]]
        held = sorted(x for x in positions[idx].tolist() if x >= 0)
        kept = positions[idx][keep[idx]].tolist()
        if not _due(policy, int(buf.fill[idx[1]]), n):  # row 3, off the interval
            assert n % R and kept == held
            continue
        # the pinned prompt entries, the newest eligible ones, the window: T in all
        pins = _n_pinned(policy, p)
        eligible = [x for x in held if pins <= x < p + n - R]
        assert kept == list(range(pins)) + eligible[len(eligible) - (K_SEL - pins):] + list(range(p + n - R, p + n))
        if policy.protect == "none":  # Recency's control: the newest T entries
            assert kept == held[-T:]
        if policy.protect == "sinks:4":  # StreamingLLM: positions 0..3 (or a shorter whole prompt), the newest T - 4
            sinks = list(range(min(p, 4)))
            assert kept == sinks + [x for x in held if x >= len(sinks)][-(T - len(sinks)):]


def test_defaults_and_names():
    assert (Recency.name, Recency().protect) == ("recency", "none")
    assert (StreamingLLM.name, StreamingLLM().protect) == ("streaming", "sinks:4")
    assert (H2O.name, H2O().protect, H2O().needs) == ("h2o", "none", ScoringNeeds(attention_sum=True))
    assert (TOVA.name, TOVA().protect, TOVA().needs) == ("tova", "none", ScoringNeeds(query_window=1))
    assert RandomAttention().needs == ScoringNeeds() and not RandomAttention().needs.any
    assert (H2O().budget, H2O().window, H2O().interval) == (1024, 64, 64)
    assert (TOVA(budget=T, buffer=R).window, TOVA(budget=T, buffer=R).interval) == (R, R)
    assert Recency.from_selected(K_SEL, window=R) == Recency(budget=T, window=R)
    with pytest.raises(ValueError, match="attention_sum"):
        H2O(budget=T, buffer=R).scores(_buffer(np.random.default_rng(0), [4]), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="queries"):
        TOVA(budget=T, buffer=R).scores(_buffer(np.random.default_rng(0), [4]), jnp.zeros(1, jnp.int32))


# ---------------------------------------------------------------- H2O


@pytest.mark.parametrize("protect", ["none", "prompt", "sinks:4"])
def test_h2o_keep_sets_equal_numpy_with_ties(protect):
    rng = np.random.default_rng(1)
    buf = _buffer(rng)
    sums = rng.integers(0, 4, buf.positions.shape).astype(np.float32)  # coarse: many ties
    sums = np.where(np.asarray(buf.valid), sums, 0.0)
    obs = Observations(attention_sum=jnp.asarray(sums))
    policy = H2O(budget=T, buffer=R, protect=protect)
    np.testing.assert_array_equal(np.asarray(policy.scores(buf, jnp.zeros(4, jnp.int32), obs)), sums)
    keep = _keep_mask(policy, buf, obs)
    np.testing.assert_array_equal(keep, _np_keep(policy, buf, sums))
    _assert_round(policy, buf, keep)


@pytest.mark.parametrize("heads", [2, 4, 8])  # 1, 2, 4 query heads per KV head
def test_slot_attention_equals_numpy(heads):
    rng = np.random.default_rng(heads)
    b, k, s, t, d = 2, 2, 11, 3, 8
    q = rng.standard_normal((b, t, heads, d)).astype(np.float32)
    keys = rng.standard_normal((b, k, s, d)).astype(np.float32)
    positions = np.tile(np.arange(s), (b, k, 1)).astype(np.int32)
    positions[0, 1, [2, 5]] = -1  # holes
    positions[1, :, 9:] = -1  # empty tail
    query_positions = np.array([[6, 7, 8], [3, 8, 10]], np.int32)
    got = np.asarray(slot_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(positions),
                                    jnp.asarray(query_positions)))
    want = np.zeros((b, k, t, s))
    g = heads // k
    for row in range(b):
        for h in range(heads):
            kv = h // g
            for i in range(t):
                seen = [j for j in range(s) if 0 <= positions[row, kv, j] <= query_positions[row, i]]
                logits = np.array([q[row, i, h] @ keys[row, kv, j] / np.sqrt(d) for j in seen], np.float64)
                want[row, kv, i, seen] += _np_softmax(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_reorder_moves_attention_sums_with_their_slots():
    rng = np.random.default_rng(2)
    prompt_lens = [5, 9]
    buf = _buffer(rng, prompt_lens)
    sums = np.where(np.asarray(buf.valid), rng.random(buf.positions.shape), 0.0).astype(np.float32)
    keep = _np_keep(Recency(budget=T, buffer=R), buf, rng.random(buf.positions.shape))
    compacted, order = compact(buf, jnp.asarray(keep))
    np.testing.assert_array_equal(np.asarray(compacted.fill), [T, T])
    moved = np.asarray(reorder(Observations(attention_sum=jnp.asarray(sums)), order, compacted.valid).attention_sum)
    after = np.asarray(compacted.positions)
    before = np.asarray(buf.positions)
    for idx in np.ndindex(before.shape[:3]):
        kept_slots = np.flatnonzero(keep[idx])
        want = np.zeros(before.shape[-1], np.float32)
        want[: len(kept_slots)] = sums[idx][kept_slots]
        np.testing.assert_array_equal(moved[idx], want)
        by_position = dict(zip(before[idx].tolist(), sums[idx].tolist()))
        for slot, pos in enumerate(after[idx]):
            assert moved[idx][slot] == (by_position[pos] if pos >= 0 else 0.0)


# ---------------------------------------------------------------- TOVA


def _np_tova(query, keys, positions):
    """query [l, b, h, d], keys [l, b, k, s, d]: mean over all heads of softmax over valid slots."""
    l, b, h, d = query.shape
    k, s = keys.shape[2], keys.shape[3]
    out = np.zeros((l, b, k, s))
    for layer in range(l):
        for row in range(b):
            mean = np.zeros(s)
            for head in range(h):
                kv = head // (h // k)
                seen = [j for j in range(s) if positions[layer, row, kv, j] >= 0]
                logits = np.array([query[layer, row, head] @ keys[layer, row, kv, j] / np.sqrt(d) for j in seen])
                mean[seen] += _np_softmax(logits) / h
            out[layer, row] = mean
    return out


@pytest.mark.parametrize("heads,same_heads", [(2, True), (4, True), (8, False)])
def test_tova_scores_and_keep_sets_equal_numpy(heads, same_heads):
    rng = np.random.default_rng(heads)
    prompt_lens = [5, 9]
    buf = _buffer(rng, prompt_lens, same_heads=same_heads)
    keys = np.array(buf.keys)
    keys[:, :, :, 7] = keys[:, :, :, 3]  # identical keys in every head: a tie, won by slot 3
    keys[:, :, :, 12] = keys[:, :, :, 10]
    buf = dataclasses.replace(buf, keys=jnp.asarray(keys))
    query = rng.standard_normal((2, 2, heads, 8)).astype(np.float32)
    obs = Observations(queries=jnp.asarray(query[:, :, :, None]))
    want = _np_tova(query, keys, np.asarray(buf.positions))
    got = np.asarray(jax.vmap(tova_scores)(jnp.asarray(query), buf.keys, buf.valid))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    policy = TOVA(budget=T, buffer=R)
    np.testing.assert_allclose(np.asarray(policy.scores(buf, jnp.zeros(2, jnp.int32), obs)), want, rtol=1e-5,
                               atol=1e-7)
    keep = _keep_mask(policy, buf, obs)
    np.testing.assert_array_equal(keep, _np_keep(policy, buf, want))
    _assert_round(policy, buf, keep)
    assert (got[..., 3] == got[..., 7]).all()
    if same_heads:  # one keep-set per layer: every KV head keeps the same slots
        assert (keep == keep[:, :, :1]).all()


# ---------------------------------------------------------------- through generate on a tiny model


PROMPTS = [np.random.default_rng(0).integers(3, 256, size=n).tolist() for n in (5, 17, 11)]
BUDGET, INTERVAL = 24, 8  # 17 > K_sel = 16: the second prompt's tail would compete under protect "prompt"
POLICIES = {
    "random": RandomAttention(budget=BUDGET, buffer=INTERVAL),  # traced only (no generation)
    "h2o": H2O(budget=BUDGET, buffer=INTERVAL),
    "tova": TOVA(budget=BUDGET, buffer=INTERVAL),
    "streaming": StreamingLLM(budget=BUDGET, buffer=INTERVAL),
    "recency": Recency(budget=BUDGET, buffer=INTERVAL),
}


@pytest.fixture(scope="module")
def runs(tiny_model):
    return {name: randkv_jax.generate(tiny_model, PROMPTS, policy=policy, max_new_tokens=80, chat=False,
                                      ignore_eos=True, return_state=True)
            for name, policy in POLICIES.items() if name != "random"}


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming", "recency"])
def test_every_policy_generates_within_the_bound(runs, name):
    out = runs[name]
    policy, buffer = POLICIES[name], out.state.buffer
    positions = np.asarray(buffer.positions)
    for row, (p, s) in enumerate(zip(PROMPTS, out.stats)):
        n = int(buffer.generated[row])
        fill, peak, rounds, _ = simulate_fill(policy, len(p), n)
        assert s.new_tokens == 80 and n == 79 and rounds > 0
        assert s.evictions == rounds and s.held_after_round == BUDGET  # every round ends at exactly T held
        assert s.peak_slots == peak <= max(len(p), BUDGET) + INTERVAL
        held = positions[:, row]
        assert int(buffer.fill[row]) == fill and ((held >= 0).sum(-1) == fill).all()
        assert (held[..., :1] >= 0).all() and (held.max(-1) == len(p) + n - 1).all()  # the newest is held
    if name == "h2o":  # accumulated attention lives in held slots only
        sums = np.asarray(out.state.observations.attention_sum)
        assert (sums[positions < 0] == 0).all() and (sums[positions >= 0] > 0).all()
    if name == "tova":  # one keep-set per layer
        assert (positions == positions[:, :, :1]).all()


@pytest.mark.parametrize("name", ["recency", "streaming"])
def test_recency_and_streaming_keep_the_newest(runs, name):
    out = runs[name]
    positions = np.asarray(out.state.buffer.positions)
    for row, p in enumerate(PROMPTS):
        n = int(out.state.buffer.generated[row])
        last_round = simulate_fill(POLICIES[name], len(p), n)[3]
        sinks = list(range(4)) if name == "streaming" else []
        # the last round kept the sinks and the newest T - sinks; the tokens since were appended
        newest = list(range(len(p) + last_round - (BUDGET - len(sinks)), len(p) + n))
        for held in positions[:, row].reshape(-1, positions.shape[-1]):
            assert held[held >= 0].tolist() == sinks + newest


def test_random_attention_loop_state_and_program_have_no_observations(tiny_model):
    """Shapes only (traced, not compiled): the loop state of 3 empty slots and `decode_chunk`'s inputs."""

    def state_and_signature(name):
        spec = DecodeSpec(config=tiny_model.config, dtype=tiny_model.dtype, policy=POLICIES[name],
                          sampling=SamplingParams(0.0, 1.0, 0), chunk=8, platform="cpu")
        state = jax.eval_shape(functools.partial(empty_state, spec, 3, 128))
        text = decode_chunk.lower(tiny_model.params, state, jnp.int32(1), spec=spec).as_text()
        return state, re.search(r"func\.func public @main\((.*)", text).group(1)

    (random_state, random_main), (h2o_state, h2o_main), (tova_state, _) = map(
        state_and_signature, ["random", "h2o", "tova"])
    assert random_state.observations is None
    assert h2o_state.observations.queries is None and tova_state.observations.attention_sum is None
    leaves = len(jax.tree.leaves(random_state))
    # the buffer (generated and head ids included), 10 per-row arrays [b] or [b, .], the rounds counter
    assert leaves == len(jax.tree.leaves(random_state.buffer)) + 11 == 7 + 11
    assert len(jax.tree.leaves(h2o_state)) == leaves + 1 and len(jax.tree.leaves(tova_state)) == leaves + 1
    l, b, k, s = random_state.buffer.positions.shape
    attention_sum = f"tensor<{l}x{b}x{k}x{s}xf32>"
    assert attention_sum not in random_main and attention_sum in h2o_main
    # inputs: params, the state but `emitted` (reset by each call, never read), max_steps
    assert random_main.count("%arg") == len(jax.tree.leaves(tiny_model.params)) + leaves - 1 + 1
    assert h2o_main.count("%arg") == len(jax.tree.leaves(tiny_model.params)) + leaves + 1 - 1 + 1


def _queries_and_keys(tiny_model, sequences):
    """Post-RoPE queries [l, b, t, h, d] and keys [l, b, t, k, d] of right-padded sequences, by a
    dense causal forward pass (padding comes after every real token, so it changes nothing)."""
    c = tiny_model.config
    b, t = len(sequences), max(map(len, sequences))
    tokens = np.zeros((b, t), np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = seq

    def capture(q, k, v, inputs: DenseInputs, cache, layer):
        ctx, _ = causal_attend(q, k, v, inputs)
        qs, ks = cache
        return ctx, (qs.at[layer].set(q), ks.at[layer].set(k))

    @jax.jit
    def forward(params, tokens):
        cache = (jnp.zeros((c.num_layers, b, t, c.num_heads, c.head_dim)),
                 jnp.zeros((c.num_layers, b, t, c.num_kv_heads, c.head_dim)))
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        inputs = DenseInputs(mask=jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)))
        _, (qs, ks) = Decoder(c, jnp.float32, jnp.float32, attend=capture).apply(
            {"params": params}, tokens, positions, inputs, cache)
        return qs, ks

    qs, ks = forward(tiny_model.params, jnp.asarray(tokens))
    return np.asarray(qs, np.float64), np.asarray(ks, np.float64)


def test_h2o_attention_sum_recorded_by_the_loop_equals_numpy(tiny_model):
    """No eviction (K is large): every prefill and decode query's attention, summed per KV head."""
    out = randkv_jax.generate(tiny_model, PROMPTS[:2], policy=H2O(budget=64, buffer=8), max_new_tokens=20,
                              chat=False, ignore_eos=True, return_state=True)
    assert all(s.evictions == 0 and s.held_after_round == 0 for s in out.stats)
    n = int(out.state.buffer.generated[0])
    np.testing.assert_array_equal(np.asarray(out.state.buffer.generated), [n, n])
    sums = np.asarray(out.state.observations.attention_sum)
    c = tiny_model.config
    g = c.num_heads // c.num_kv_heads
    sequences = [prompt + out.tokens[row][:n] for row, prompt in enumerate(PROMPTS[:2])]  # what the buffer got
    qs, ks = _queries_and_keys(tiny_model, sequences)
    for row, seq in enumerate(sequences):
        assert int(out.state.buffer.fill[row]) == len(seq)
        want = np.zeros((c.num_layers, c.num_kv_heads, len(seq)))
        for layer in range(c.num_layers):
            for h in range(c.num_heads):
                for t in range(len(seq)):
                    logits = ks[layer, row, : t + 1, h // g] @ qs[layer, row, t, h] / np.sqrt(c.head_dim)
                    want[layer, h // g, : t + 1] += _np_softmax(logits)
        np.testing.assert_allclose(sums[:, row, :, : len(seq)], want, rtol=1e-4, atol=1e-5)
        assert (sums[:, row, :, len(seq):] == 0).all()
