"""Sampling filters against transformers' logits warpers, and draw statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from randkv_jax.sampling import SamplingParams, filter_logits, sample_tokens


def _hf_filter(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """transformers' order: temperature, top-k, top-p (min_tokens_to_keep=1)."""
    scores = torch.tensor(logits)[None]
    scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return scores[0].numpy()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.6, top_p=0.95),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.8),
    SamplingParams(temperature=1.0, top_p=0.3),
])
def test_filters_keep_the_tokens_transformers_keeps(params):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = (rng.standard_normal(64) * 3).astype(np.float32)
        ours = np.asarray(filter_logits(jnp.asarray(logits), params))
        ref = _hf_filter(logits, params)
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
        kept = np.isfinite(ref)
        np.testing.assert_allclose(ours[kept], ref[kept], rtol=1e-6)


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 50)), jnp.float32)
    keys = jax.vmap(jax.random.key)(jnp.arange(4))
    np.testing.assert_array_equal(sample_tokens(logits, keys, jnp.full((4,), 3), SamplingParams()), logits.argmax(-1))


def test_sampled_frequencies_follow_the_filtered_distribution():
    """Chi-square of many draws (one per step) against softmax of the filtered logits."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    logits = jnp.asarray(np.random.default_rng(2).standard_normal(12) * 2, jnp.float32)
    probs = np.asarray(jax.nn.softmax(filter_logits(logits, params)), np.float64)
    keys = jax.random.key(7)[None]
    draws = jax.vmap(lambda step: sample_tokens(logits[None], keys, step[None], params)[0])(jnp.arange(20000))
    counts = np.bincount(np.asarray(draws), minlength=12)
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = counts.sum() * probs[support] / probs[support].sum()
    chi2 = stats.chisquare(counts[support], expected)
    assert chi2.pvalue > 1e-3


def test_rows_draw_from_their_own_keys():
    logits = jnp.zeros((3, 1000), jnp.float32)
    params = SamplingParams(temperature=1.0)
    keys = jax.vmap(jax.random.key)(jnp.asarray([5, 6, 5]))
    tokens = np.asarray(sample_tokens(logits, keys, jnp.ones((3,), jnp.int32), params))
    assert tokens[0] == tokens[2] != tokens[1]
    # a row's own count picks its draw: row 2 at count 1 repeats row 0's draw only at count 1
    later = np.asarray(sample_tokens(logits, keys, jnp.asarray([1, 1, 2]), params))
    assert later[0] == tokens[0] and later[2] != tokens[2]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
