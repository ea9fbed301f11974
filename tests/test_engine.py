"""The continuous-batching `Engine` on a tiny random model (float32).

The reference for every request is the same request run alone in the same engine shape (same
slots, capacity, chunk and policy, the other slots empty): its tokens must not depend on the slot
it lands in, on what runs beside it or on what ran in its slot before.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from randkv_jax import Engine, policies
from randkv_jax.policies import FullAttention, RandomAttention

SLOTS, CAPACITY, CHUNK = 3, 128, 8
RNG = np.random.default_rng(11)
# (prompt length, max_new_tokens): long-tailed, prompts shorter and longer than the budget
SHAPES = [(5, 40), (31, 12), (12, 70), (3, 9), (40, 33), (9, 55), (20, 16)]
PROMPTS = [RNG.integers(3, 256, size=n).tolist() for n, _ in SHAPES]
POLICIES = {
    "random": RandomAttention(budget=24, buffer=8),  # rounds every 8 tokens past 24 entries
    "snapkv": policies.SnapKV(budget=24, buffer=8),
    "h2o": policies.H2O(budget=24, buffer=8),
    "full": FullAttention(),
}


def _engine(model, policy, temperature=0.0, engine_class=Engine):
    return engine_class(model, policy=policy, slots=SLOTS, capacity=CAPACITY, chunk=CHUNK,
                        temperature=temperature, top_p=0.9 if temperature else 1.0)


def _submit_all(engine, order, seeds=None, **kw):
    ids = {}
    for i in order:
        _, max_new = SHAPES[i]
        ids[engine.submit(PROMPTS[i], max_new_tokens=max_new, seed=100 + i if seeds is None else seeds[i],
                          ignore_eos=True, **kw)[0]] = i
    return ids


def _alone(model, policy, i, temperature=0.0, **kw):
    engine = _engine(model, policy, temperature)
    engine.submit(PROMPTS[i], max_new_tokens=SHAPES[i][1], seed=100 + i, ignore_eos=True, **kw)
    (done,) = list(engine.run())
    assert done.slot == 0
    return done


@pytest.mark.parametrize("name, temperature", [("random", 0.0), ("random", 1.0), ("snapkv", 1.0), ("full", 1.0)])
def test_each_request_equals_itself_run_alone(tiny_model, name, temperature):
    policy = POLICIES[name]
    alone = {i: _alone(tiny_model, policy, i, temperature) for i in range(len(PROMPTS))}
    for order in (range(len(PROMPTS)), [4, 0, 6, 2, 5, 1, 3]):  # other neighbours, other slots
        engine = _engine(tiny_model, policy, temperature)
        ids = _submit_all(engine, order)
        done = {ids[c.request_id]: c for c in engine.run()}
        assert sorted(done) == list(range(len(PROMPTS)))
        assert {c.slot for c in done.values()} == set(range(SLOTS))  # requests ran in every slot
        for i, c in done.items():
            assert c.tokens == alone[i].tokens, (name, temperature, i, c.slot)
            assert len(c.tokens) == SHAPES[i][1] and c.stats.finish_reason == "length"
            assert c.stats.evictions == alone[i].stats.evictions and c.stats.peak_slots == alone[i].stats.peak_slots
        if name == "random":
            assert max(c.stats.evictions for c in done.values()) >= 5
            # refills wait for interval boundaries: one batched round per interval, as in static batching
            assert int(engine.state.rounds_run) <= -(-engine.steps // policy.interval)


class PoisoningEngine(Engine):
    """Fills the row of every departing request with NaN keys, values and observations (its
    positions stay valid): a request inserted there must see none of it."""

    def _release(self, slot):
        completion = super()._release(slot)
        s = self.state
        nan_row = lambda x: x.at[:, slot].set(jnp.nan)  # noqa: E731
        obs = s.observations
        if obs is not None:
            obs = dataclasses.replace(
                obs, **{f: nan_row(getattr(obs, f)) for f in ("queries", "attention_sum") if getattr(obs, f) is not None})
        buffer = dataclasses.replace(s.buffer, keys=nan_row(s.buffer.keys), values=nan_row(s.buffer.values))
        assert (np.asarray(buffer.positions)[:, slot] >= 0).sum() > 0
        self.state = dataclasses.replace(s, buffer=buffer, observations=obs)
        return completion


@pytest.mark.parametrize("name", ["random", "snapkv", "h2o"])
def test_a_request_in_a_slot_a_longer_one_left_sees_none_of_it(tiny_model, name):
    policy = POLICIES[name]
    engine = _engine(tiny_model, policy, engine_class=PoisoningEngine)
    # slot 0 first runs request 2 (12 + 70 tokens), then request 3 (3 + 9) after it
    first = engine.submit(PROMPTS[2], max_new_tokens=SHAPES[2][1], seed=102, ignore_eos=True)[0]
    busy = [engine.submit(PROMPTS[i], max_new_tokens=200, seed=i, ignore_eos=True)[0] for i in (0, 1)]
    later = engine.submit(PROMPTS[3], max_new_tokens=SHAPES[3][1], seed=103, ignore_eos=True)[0]
    done = {}
    for c in engine.run():
        done[c.request_id] = c
        if c.request_id == first:  # the other slots are still busy: the next request takes slot 0
            engine.cancel(busy[0]), engine.cancel(busy[1])
    assert done[first].slot == done[later].slot == 0
    assert done[later].tokens == _alone(tiny_model, policy, 3).tokens


def test_the_poison_is_potent(tiny_model):
    """Control: NaN in entries a request can see does change its tokens."""

    class PoisonLive(Engine):
        def step(self):
            if self._running and self.steps == CHUNK:  # one chunk in: poison the live row's prompt keys
                s = self.state
                self.state = dataclasses.replace(s, buffer=dataclasses.replace(
                    s.buffer, keys=s.buffer.keys.at[:, 0, :, :3].set(jnp.nan)))
            return super().step()

    engine = _engine(tiny_model, POLICIES["random"], engine_class=PoisonLive)
    engine.submit(PROMPTS[2], max_new_tokens=SHAPES[2][1], seed=102, ignore_eos=True)
    (done,) = list(engine.run())
    assert done.tokens != _alone(tiny_model, POLICIES["random"], 2).tokens


def test_samples_of_one_prompt_share_one_prefill(tiny_model):
    policy = POLICIES["random"]
    engine = _engine(tiny_model, policy, temperature=1.0)
    ids = engine.submit(PROMPTS[0], n=4, seed=[100, 200, 300, 400], max_new_tokens=30, ignore_eos=True)
    done = {c.request_id: c for c in engine.run()}
    assert engine.prefills == 1
    tokens = [done[i].tokens for i in ids]
    assert len({tuple(t) for t in tokens}) == 4  # different seeds, different samples
    for seed, t in zip((100, 200, 300, 400), tokens):
        alone = _engine(tiny_model, policy, temperature=1.0)
        alone.submit(PROMPTS[0], seed=seed, max_new_tokens=30, ignore_eos=True)
        assert next(alone.run()).tokens == t


def test_completions_come_out_as_they_finish(tiny_model):
    engine = _engine(tiny_model, POLICIES["random"])
    ids = [engine.submit(PROMPTS[i], max_new_tokens=m, ignore_eos=True)[0] for i, m in ((0, 60), (1, 10), (2, 30))]
    seen, progress = [], []
    for c in engine.run(progress=progress.append):
        seen.append(c.request_id)
        assert c.stats.queue_seconds >= 0 and c.stats.first_token_seconds > 0
    assert seen == [ids[1], ids[2], ids[0]]
    assert [p.completed for p in progress][-1] == 3 and progress[-1].queued == progress[-1].running == 0
    assert progress[0].eta_seconds is None or progress[0].eta_seconds >= 0
    assert progress[-1].tokens == 100 and progress[-1].tokens_per_second > 0


def test_stop_tokens_end_a_request(tiny_model):
    alone = _alone(tiny_model, POLICIES["random"], 2)
    stop = alone.tokens[20]
    first = alone.tokens.index(stop)
    engine = _engine(tiny_model, POLICIES["random"])
    engine.submit(PROMPTS[2], max_new_tokens=SHAPES[2][1], seed=102, stop_tokens=[stop], ignore_eos=True)
    (done,) = list(engine.run())
    assert done.tokens == alone.tokens[: first + 1] and done.stats.finish_reason == "stop"


def test_cancel_a_queued_and_a_running_request(tiny_model):
    engine = Engine(tiny_model, policy=POLICIES["random"], slots=1, capacity=CAPACITY, chunk=CHUNK)
    a, b, c = (engine.submit(PROMPTS[i], max_new_tokens=40, seed=100 + i, ignore_eos=True)[0] for i in (0, 1, 2))
    assert engine.cancel(b) and not engine.cancel(999)
    done = {x.request_id: x for x in engine.step()}  # b's cancellation comes out; a is running
    assert list(done) == [b]
    assert engine.cancel(a)
    done.update({x.request_id: x for x in engine.run()})
    assert done[b].stats.finish_reason == "cancelled" and done[b].tokens == [] and done[b].slot is None
    assert done[a].stats.finish_reason == "cancelled" and 0 < len(done[a].tokens) < 40
    assert done[c].stats.finish_reason == "length" and len(done[c].tokens) == 40
    assert not engine.cancel(c)  # finished


def test_bad_requests_are_refused_and_the_others_go_on(tiny_model):
    engine = Engine(tiny_model, policy=FullAttention(), slots=2, capacity=CAPACITY, chunk=CHUNK)
    good = engine.submit(PROMPTS[0], max_new_tokens=20, ignore_eos=True)[0]
    with pytest.raises(ValueError, match="zero tokens"):
        engine.submit([], max_new_tokens=5)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.submit(PROMPTS[0], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"request 1 does not fit: its prompt \(40 tokens.*needs 140 KV slots.*hold 128"):
        engine.submit(PROMPTS[4], max_new_tokens=100)
    with pytest.raises(ValueError, match=r"request 1 does not fit: its prompt \(200 tokens, prefilled at 256\)"):
        engine.submit(list(range(3, 203)), max_new_tokens=5)
    with pytest.raises(ValueError, match="token ids must lie in"):
        engine.submit([5, 10_000])
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.submit("a string")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        Engine(tiny_model, policy="nope", slots=2, capacity=CAPACITY)
    later = engine.submit(PROMPTS[1], max_new_tokens=7, ignore_eos=True)[0]
    done = {c.request_id: c for c in engine.run()}
    assert sorted(done) == [good, later] and len(done[good].tokens) == 20 and len(done[later].tokens) == 7


def test_chunks_are_whole_intervals(tiny_model):
    assert Engine(tiny_model, policy=RandomAttention(budget=24, buffer=8), slots=1, capacity=CAPACITY,
                  chunk=12).spec.chunk == 16
    assert Engine(tiny_model, policy=FullAttention(), slots=1, capacity=CAPACITY, chunk=12).spec.chunk == 12


@pytest.mark.parametrize("name", ["random", "snapkv"])
def test_unstacked_layers_decode_what_scanned_layers_do(tiny_model, name):
    # On CPU the decode program runs the layers unrolled over per-layer parameter copies
    # (`DecodeSpec.unstacked`); the scanned program over the stacked tree must emit the same tokens.
    unstacked, scanned = (_engine(tiny_model, POLICIES[name], temperature=1.0) for _ in range(2))
    assert unstacked.spec.unstacked
    scanned.spec = dataclasses.replace(scanned.spec, unstacked=False)
    scanned._decode_params = tiny_model.params
    tokens = []
    for engine in (unstacked, scanned):
        ids = _submit_all(engine, range(len(PROMPTS)))
        tokens.append({ids[c.request_id]: c.tokens for c in engine.run()})
    assert tokens[0] == tokens[1]
    assert sum(len(t) for t in tokens[0].values()) == sum(n for _, n in SHAPES)
