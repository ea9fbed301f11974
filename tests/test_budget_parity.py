"""Budget parity: every eviction policy, in every `protect` regime, holds exactly T entries per
(layer, row, KV head) right after each of its rounds, inside the real decode loop.

The loop is driven chunk by chunk with chunks of `interval` steps, so every chunk ends on a round
boundary and the state it returns is the buffer right after that round (the host reads it before
the next chunk). The expected schedule, pins and window are computed here from the rule as the
paper's engine states it (`../shared/reference/algorithms.md` §1.2-1.3), not from the library:
  - a row's round runs when its generated count g is a multiple of i and it holds more than T;
  - it keeps the w newest positions, positions 0 .. min(P, N, K_sel - 1) - 1 (N = P for
    "prompt", 0 for "none", N for "sinks:N") and selected entries, T in all (K_sel = T - w);
  - the peak is max(P, T) + i.
The batch mixes prompts shorter and longer than K_sel, and window != interval.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import randkv_jax
from randkv_jax import policies
from randkv_jax.calibration import calibrate
from randkv_jax.engine import Engine

T, W, I = 32, 8, 4  # budget, window, interval: K_sel = 24
PROMPT_LENS = (5, 19, 40)  # shorter than K_sel, just under it, longer (its tail competes)
NEW_TOKENS = 49  # 48 decode steps after the first token: 12 chunks of I
PROTECT = {"prompt": None, "none": 0, "sinks:3": 3}
EVICTING = [name for name in policies.available() if name != "full"]


@pytest.fixture(scope="module")
def stats_dir(tiny_model, tmp_path_factory):
    ids = np.random.default_rng(0).integers(3, tiny_model.config.vocab_size, size=96).tolist()
    return calibrate(tiny_model, ids, tmp_path_factory.mktemp("stats") / "stats")


def _policy(name, protect, stats_dir):
    extra = {"stats": stats_dir} if name == "triattention" else {}
    return policies.get(name, budget=T, window=W, interval=I, protect=protect, **extra)


def _expected_pins(protect, prompt_len):
    n = PROTECT[protect]
    return min(prompt_len if n is None else n, prompt_len, T - W - 1)


@pytest.mark.parametrize("protect", list(PROTECT))
@pytest.mark.parametrize("name", EVICTING)
def test_every_round_leaves_exactly_the_budget(tiny_model, stats_dir, name, protect):
    policy = _policy(name, protect, stats_dir)
    rng = np.random.default_rng(1)
    engine = Engine(tiny_model, policy=policy, slots=len(PROMPT_LENS), max_prompt_tokens=max(PROMPT_LENS),
                    max_new_tokens=NEW_TOKENS, chunk=I)
    assert engine.spec.chunk == I
    for row, n in enumerate(PROMPT_LENS):
        engine.submit(rng.integers(3, 256, size=n).tolist(), max_new_tokens=NEW_TOKENS, seed=row, ignore_eos=True)
    held = list(PROMPT_LENS)  # the rule's count per row, tracked independently
    rounds = [0] * len(PROMPT_LENS)
    while engine.running or engine.queued:
        engine.step()
        state = engine.state
        g = int(state.buffer.generated[0])
        positions = np.asarray(state.buffer.positions)
        assert g % I == 0 and (np.asarray(state.buffer.generated) == g).all()
        for row, p in enumerate(PROMPT_LENS):
            held[row] += I
            assert held[row] <= max(p, T) + I  # the peak, reached right before a round
            if held[row] > T:  # due: the round ran inside the step that brought g to a multiple of I
                held[row], rounds[row] = T, rounds[row] + 1
                pins, window = set(range(_expected_pins(protect, p))), set(range(p + g - W, p + g))
                for head in positions[:, row].reshape(-1, positions.shape[-1]):
                    kept = set(head[head >= 0].tolist())
                    assert len(kept) == T, f"row {row} holds {len(kept)} after the round at g={g}"
                    assert pins <= kept and window <= kept
                    assert (head[:T] >= 0).all() and (head[T:] == -1).all()  # compacted to the front
            else:
                assert ((positions[:, row] >= 0).sum(-1) == held[row]).all()
        np.testing.assert_array_equal(np.asarray(state.held_after_round), [T if r else 0 for r in rounds])
    assert all(r > 1 for r in rounds), rounds
    np.testing.assert_array_equal(np.asarray(state.evictions), rounds)
    peaks = np.asarray(state.peak_slots)
    for row, p in enumerate(PROMPT_LENS):
        assert peaks[row] == max(p, T) + I
    assert engine.capacity == 128 and engine.capacity >= max(max(p, T) + I for p in PROMPT_LENS)
    # one round per interval for the whole batch: the long prompt is due at every boundary, the
    # others join it on the same steps
    assert int(state.rounds_run) == (NEW_TOKENS - 1) // I


def test_policies_hold_the_same_number_of_entries_at_one_budget(tiny_model, stats_dir):
    """The comparison the paper makes: at one budget, Random Attention (prompt pinned) and SnapKV /
    R-KV / VaSE (unprotected) hold the same number of entries; only which ones differ."""
    prompts = [np.random.default_rng(2).integers(3, 256, size=n).tolist() for n in (12, 30)]
    held = {}
    for name in ("random", "snapkv", "rkv", "vase", "triattention", "recency"):
        extra = {"stats": stats_dir} if name == "triattention" else {}
        policy = policies.get(name, budget=T, buffer=8, **extra)
        out = randkv_jax.generate(tiny_model, prompts, policy=policy, max_new_tokens=64, chat=False, ignore_eos=True)
        held[name] = [(s.held_after_round, s.peak_slots) for s in out.stats]
    assert len(set(map(tuple, held.values()))) == 1, held
    assert held["random"] == [(T, T + 8), (T, T + 8)]


def test_full_attention_is_a_policy_that_is_never_due(tiny_model):
    full = policies.FullAttention()
    prompts = [[5, 6, 7], [8, 9]]
    out = randkv_jax.generate(tiny_model, prompts, policy=full, max_new_tokens=20, chat=False, ignore_eos=True,
                              return_state=True)
    assert not bool(jnp.any(full.due(out.state.buffer)))
    assert [s.evictions for s in out.stats] == [0, 0] and [s.peak_slots for s in out.stats] == [22, 21]  # the last token is not written
    assert bool(jnp.all(full.keep_mask(out.state.buffer, out.state.row_seeds, platform="cpu") == out.state.buffer.valid))
    assert dataclasses.is_dataclass(full) and full.capacity(3, 20) == 23
