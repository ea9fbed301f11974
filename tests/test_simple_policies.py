"""H2O, TOVA, StreamingLLM and Recency: scores and keep-sets against NumPy, and in `generate`.

The NumPy references are the published rules read literally (loops over layers, rows, heads and
slots): H2O's accumulated attention and its top-K, TOVA's head-averaged attention of the newest
query, and the position score of Recency / StreamingLLM.
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
from randkv_jax.buffer import KVBuffer, compact, compaction_order
from randkv_jax.decode import DecodeSpec, decode_chunk, prefill
from randkv_jax.models.decoder import Decoder, causal_attend
from randkv_jax.observations import Observations, ScoringNeeds, reorder, slot_attention
from randkv_jax.policies.h2o import H2O
from randkv_jax.policies.random import RandomAttention
from randkv_jax.policies.recency import Recency, recency_scores
from randkv_jax.policies.streaming import StreamingLLM
from randkv_jax.policies.tova import TOVA, tova_scores
from randkv_jax.sampling import SamplingParams
from tests.hf_tiny import save_tiny

K, R, N_GEN = 6, 8, 40  # simulated rounds: budget, window, tokens generated so far


# ---------------------------------------------------------------- simulated buffers and references


def _buffer(rng, prompt_lens, layers=2, kv_heads=2, d=8, same_heads=False, holes=12):
    """A buffer after N_GEN generated tokens: the whole prompt, `holes`+row random older generated
    entries per (layer, head) (per layer when `same_heads`), the R-token window; 3 empty slots."""
    b = len(prompt_lens)
    fills = [p + holes + row + R for row, p in enumerate(prompt_lens)]
    s = max(fills) + 3
    positions = np.full((layers, b, kv_heads, s), -1, np.int32)
    for l in range(layers):
        for row, p in enumerate(prompt_lens):
            shared = rng.choice(np.arange(p, p + N_GEN - R), holes + row, replace=False)
            for h in range(kv_heads):
                older = shared if same_heads else rng.choice(np.arange(p, p + N_GEN - R), holes + row, replace=False)
                held = np.concatenate([np.arange(p), np.sort(older), np.arange(p + N_GEN - R, p + N_GEN)])
                positions[l, row, h, : len(held)] = held
    keys = rng.standard_normal((layers, b, kv_heads, s, d)).astype(np.float32)
    return KVBuffer(
        keys=jnp.asarray(keys), values=jnp.zeros_like(jnp.asarray(keys)), positions=jnp.asarray(positions),
        prompt_lens=jnp.asarray(prompt_lens, jnp.int32), fill=jnp.asarray(fills, jnp.int32),
    )


def _protected_prompt(protect, p):
    """How many leading prompt tokens `protect` keeps."""
    return {"prompt": p, "none": 0}[protect] if protect in ("prompt", "none") else min(int(protect[6:]), p)


def _np_keep(positions, prompt_lens, protect, scores):
    """Protected entries plus the K highest-scoring eligible ones (ties -> lower slot), after N_GEN."""
    keep = np.zeros(positions.shape, bool)
    for idx in np.ndindex(positions.shape[:3]):
        p = prompt_lens[idx[1]]
        sinks = _protected_prompt(protect, p)
        pos = positions[idx]
        protected = [t for t in range(len(pos)) if pos[t] >= 0 and (pos[t] < sinks or pos[t] >= p + N_GEN - R)]
        eligible = [t for t in range(len(pos)) if pos[t] >= 0 and t not in protected]
        chosen = sorted(eligible, key=lambda t: (-scores[idx][t], t))[:K]
        keep[idx][protected + chosen] = True
    return keep


def _keep_mask(policy, buf, observations=None):
    keep_mask = jax.jit(policy.keep_mask)  # one compilation instead of op-by-op dispatch
    return np.asarray(keep_mask(buf, jnp.int32(N_GEN), jnp.zeros(buf.fill.shape, jnp.int32), observations))


def _np_softmax(logits):
    e = np.exp(logits - logits.max())
    return e / e.sum()


# ---------------------------------------------------------------- Recency and StreamingLLM


@pytest.mark.parametrize("policy", [Recency(budget=K, buffer=R), StreamingLLM(budget=K, buffer=R),
                                    Recency(budget=K, buffer=R, protect="prompt"),
                                    StreamingLLM(budget=K, buffer=R, protect="sinks:2")])
def test_position_scores_and_keep_sets_equal_numpy(policy):
    rng = np.random.default_rng(0)
    prompt_lens = [5, 9, 3]
    buf = _buffer(rng, prompt_lens)
    positions = np.asarray(buf.positions)
    np.testing.assert_array_equal(np.asarray(recency_scores(buf.positions)), positions.astype(np.float32))
    expected = _np_keep(positions, prompt_lens, policy.protect, positions)
    np.testing.assert_array_equal(_keep_mask(policy, buf), expected)
    for idx in np.ndindex(positions.shape[:3]):  # the protected prompt, the K newest eligible, the window
        p, n_sinks = prompt_lens[idx[1]], _protected_prompt(policy.protect, prompt_lens[idx[1]])
        kept = positions[idx][expected[idx]].tolist()
        eligible = sorted(x for x in positions[idx].tolist() if n_sinks <= x < p + N_GEN - R)
        assert kept == list(range(n_sinks)) + eligible[-K:] + list(range(p + N_GEN - R, p + N_GEN))


def test_defaults_and_names():
    assert (Recency.name, Recency().protect) == ("recency", "none")
    assert (StreamingLLM.name, StreamingLLM().protect) == ("streaming", "sinks:4")
    assert (H2O.name, H2O().protect, H2O().needs) == ("h2o", "none", ScoringNeeds(attention_sum=True))
    assert (TOVA.name, TOVA().protect, TOVA().needs) == ("tova", "none", ScoringNeeds(query_window=1))
    assert RandomAttention().needs == ScoringNeeds() and not RandomAttention().needs.any
    with pytest.raises(ValueError, match="attention_sum"):
        H2O(budget=K, buffer=R).scores(_buffer(np.random.default_rng(0), [4]), jnp.int32(N_GEN), jnp.zeros(1))
    with pytest.raises(ValueError, match="queries"):
        TOVA(budget=K, buffer=R).scores(_buffer(np.random.default_rng(0), [4]), jnp.int32(N_GEN), jnp.zeros(1))


# ---------------------------------------------------------------- H2O


@pytest.mark.parametrize("protect", ["none", "prompt", "sinks:4"])
def test_h2o_keep_sets_equal_numpy_with_ties(protect):
    rng = np.random.default_rng(1)
    prompt_lens = [5, 9, 3]
    buf = _buffer(rng, prompt_lens)
    sums = rng.integers(0, 4, buf.positions.shape).astype(np.float32)  # coarse: many ties
    sums = np.where(np.asarray(buf.valid), sums, 0.0)
    obs = Observations(attention_sum=jnp.asarray(sums))
    policy = H2O(budget=K, buffer=R, protect=protect)
    np.testing.assert_array_equal(np.asarray(policy.scores(buf, jnp.int32(N_GEN), None, obs)), sums)
    np.testing.assert_array_equal(_keep_mask(policy, buf, obs), _np_keep(np.asarray(buf.positions), prompt_lens,
                                                                         protect, sums))


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
    keep = _np_keep(np.asarray(buf.positions), prompt_lens, "none", rng.random(buf.positions.shape))
    keep_j = jnp.asarray(keep)
    moved = np.asarray(reorder(Observations(attention_sum=jnp.asarray(sums)), compaction_order(keep_j), keep_j)
                       .attention_sum)
    after = np.asarray(compact(buf, keep_j).positions)
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
    policy = TOVA(budget=K, buffer=R)
    np.testing.assert_allclose(np.asarray(policy.scores(buf, jnp.int32(N_GEN), None, obs)), want, rtol=1e-5, atol=1e-7)
    keep = _keep_mask(policy, buf, obs)
    np.testing.assert_array_equal(keep, _np_keep(np.asarray(buf.positions), prompt_lens, "none", want))
    assert (got[..., 3] == got[..., 7]).all()
    if same_heads:  # one keep-set per layer: every KV head keeps the same slots
        assert (keep == keep[:, :, :1]).all()


# ---------------------------------------------------------------- through generate on a tiny model


PROMPTS = [np.random.default_rng(0).integers(3, 256, size=n).tolist() for n in (5, 17, 11)]
POLICIES = {
    "random": RandomAttention(budget=16, buffer=8),  # traced only (no generation)
    "h2o": H2O(budget=16, buffer=8),
    "tova": TOVA(budget=16, buffer=8),
    "streaming": StreamingLLM(budget=16, buffer=8),
    "recency": Recency(budget=16, buffer=8),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_untied")
    save_tiny("qwen3_untied", directory, seed=3)
    return randkv_jax.load_model(directory, dtype="float32")


@pytest.fixture(scope="module")
def runs(model):
    return {name: randkv_jax.generate(model, PROMPTS, policy=policy, max_new_tokens=80, chat=False,
                                      ignore_eos=True, return_state=True)
            for name, policy in POLICIES.items() if name != "random"}


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming", "recency"])
def test_every_policy_generates_within_the_bound(runs, name):
    K_, r = 16, 8
    out = runs[name]
    positions = np.asarray(out.state.buffer.positions)
    n = int(out.state.step)
    for row, (p, s) in enumerate(zip(PROMPTS, out.stats)):
        assert s.new_tokens == 80 and s.evictions > 0
        assert s.peak_slots <= len(p) + K_ + 2 * r
        held = positions[:, row]
        assert ((held >= 0).sum(-1) <= len(p) + K_ + 2 * r).all()
        assert (held[..., :1] >= 0).all() and (held.max(-1) == len(p) + n - 1).all()  # the newest is held
    if name == "h2o":  # accumulated attention lives in held slots only
        sums = np.asarray(out.state.observations.attention_sum)
        assert (sums[positions < 0] == 0).all() and (sums[positions >= 0] > 0).all()
    if name == "tova":  # one keep-set per layer
        assert (positions == positions[:, :, :1]).all()


@pytest.mark.parametrize("name", ["recency", "streaming"])
def test_recency_and_streaming_keep_the_newest(runs, name):
    out = runs[name]
    n = int(out.state.step)
    last_round = n - n % 8
    positions = np.asarray(out.state.buffer.positions)
    for row, p in enumerate(PROMPTS):
        sinks = list(range(4)) if name == "streaming" else []
        newest = list(range(len(p) + last_round - 16 - 8, len(p) + n))  # K + r kept at the last round, then appended
        for held in positions[:, row].reshape(-1, positions.shape[-1]):
            assert held[held >= 0].tolist() == sinks + newest


def test_random_attention_loop_state_and_program_have_no_observations(model):
    """Shapes only (traced, not compiled): the state `prefill` builds and `decode_chunk`'s inputs."""
    prompts, lens, seeds = jnp.zeros((3, 64), jnp.int32), jnp.asarray([5, 17, 11]), jnp.arange(3)

    def state_and_signature(name):
        spec = DecodeSpec(config=model.config, dtype=model.dtype, policy=POLICIES[name],
                          sampling=SamplingParams(0.0, 1.0, 0), max_new_tokens=80, stop_ids=(), pad_id=0)
        state = jax.eval_shape(functools.partial(prefill, spec=spec, capacity=128), model.params, prompts, lens, seeds)
        text = decode_chunk.lower(model.params, state, jnp.int32(1), spec=spec).as_text()
        return state, re.search(r"func\.func public @main\((.*)", text).group(1)

    (random_state, random_main), (h2o_state, h2o_main), (tova_state, _) = map(
        state_and_signature, ["random", "h2o", "tova"])
    assert random_state.observations is None
    assert h2o_state.observations.queries is None and tova_state.observations.attention_sum is None
    leaves = len(jax.tree.leaves(random_state))
    assert len(jax.tree.leaves(h2o_state)) == leaves + 1 and len(jax.tree.leaves(tova_state)) == leaves + 1
    l, b, k, s = random_state.buffer.positions.shape
    attention_sum = f"tensor<{l}x{b}x{k}x{s}xf32>"
    assert attention_sum not in random_main and attention_sum in h2o_main
    assert random_main.count("%arg") == len(jax.tree.leaves(model.params)) + leaves + 1
    assert h2o_main.count("%arg") == len(jax.tree.leaves(model.params)) + leaves + 2


def _queries_and_keys(model, sequences):
    """Post-RoPE queries [l, b, t, h, d] and keys [l, b, t, k, d] of right-padded sequences, by a
    dense causal forward pass (padding comes after every real token, so it changes nothing)."""
    c = model.config
    b, t = len(sequences), max(map(len, sequences))
    tokens = np.zeros((b, t), np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = seq

    def capture(q, k, v, shared, state, layer):
        ctx, _ = causal_attend(q, k, v, shared)
        qs, ks = state
        return ctx, (qs.at[layer].set(q), ks.at[layer].set(k))

    @jax.jit
    def forward(params, tokens):
        state = (jnp.zeros((c.num_layers, b, t, c.num_heads, c.head_dim)),
                 jnp.zeros((c.num_layers, b, t, c.num_kv_heads, c.head_dim)))
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        _, (qs, ks) = Decoder(c, jnp.float32, jnp.float32, attend=capture).apply(
            {"params": params}, tokens, positions, mask, state)
        return qs, ks

    qs, ks = forward(model.params, jnp.asarray(tokens))
    return np.asarray(qs, np.float64), np.asarray(ks, np.float64)


def test_h2o_attention_sum_recorded_by_the_loop_equals_numpy(model):
    """No eviction (K is large): every prefill and decode query's attention, summed per KV head."""
    out = randkv_jax.generate(model, PROMPTS[:2], policy=H2O(budget=64, buffer=8), max_new_tokens=20,
                              chat=False, ignore_eos=True, return_state=True)
    assert all(s.evictions == 0 for s in out.stats)
    n = int(out.state.step)
    sums = np.asarray(out.state.observations.attention_sum)
    c = model.config
    g = c.num_heads // c.num_kv_heads
    sequences = [prompt + out.tokens[row][:n] for row, prompt in enumerate(PROMPTS[:2])]  # what the buffer got
    qs, ks = _queries_and_keys(model, sequences)
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
