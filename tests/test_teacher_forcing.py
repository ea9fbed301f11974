"""Teacher forcing through the engine: forced tokens are fed instead of sampled ones, and each
produced token's log-probability and argmax flag match a cache-free forward pass (full attention)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from randkv_jax.engine import Engine
from randkv_jax.models import forward
from randkv_jax.policies import FullAttention, RandomAttention


def test_forced_tokens_logprobs_and_greedy_flags_match_a_forward_pass(tiny_model):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 256, size=9).tolist()
    forced = rng.integers(3, 256, size=40).tolist()
    engine = Engine(tiny_model, policy=FullAttention(), slots=2, max_prompt_tokens=16, max_new_tokens=64,
                    temperature=0.8, chunk=16, forced_tokens=48)
    engine.submit(prompt, max_new_tokens=len(forced) + 5, forced=forced, seed=3, ignore_eos=True, chat=False)
    (done,) = list(engine.run())
    assert done.tokens[: len(forced)] == forced and len(done.tokens) == len(forced) + 5
    assert len(done.logprobs) == len(done.greedy) == len(done.tokens) - 1
    sequence = np.asarray([prompt + done.tokens])
    logits = np.asarray(forward(tiny_model, sequence), np.float64)[0, len(prompt):-1]  # predicts tokens[1:]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    want = logp[np.arange(len(done.tokens) - 1), done.tokens[1:]]
    np.testing.assert_allclose(done.logprobs, want, atol=1e-4)
    np.testing.assert_array_equal(done.greedy, logits.argmax(-1) == np.asarray(done.tokens[1:]))
    assert not all(done.greedy[: len(forced) - 1])  # random forced tokens are not what greedy decoding picks


def test_forcing_is_refused_beyond_the_engine_width(tiny_model):
    engine = Engine(tiny_model, policy=RandomAttention(budget=32, window=8), slots=1, max_prompt_tokens=16,
                    max_new_tokens=32, forced_tokens=4)
    with pytest.raises(ValueError, match="5 forced tokens, this engine takes at most 4"):
        engine.submit([5, 6], forced=[1, 2, 3, 4, 5], chat=False)
    with pytest.raises(ValueError, match="forced token ids"):
        engine.submit([5, 6], forced=[1, 999], chat=False)
    plain = Engine(tiny_model, policy=RandomAttention(budget=32, window=8), slots=1, max_prompt_tokens=16,
                   max_new_tokens=32)
    with pytest.raises(ValueError, match="at most 0"):
        plain.submit([5, 6], forced=[1], chat=False)
    assert jax.tree.leaves(plain.state.forced) == []
