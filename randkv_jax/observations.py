"""What scoring policies observe during decoding, carried in the loop state only when needed.

A policy declares its needs (`ScoringNeeds`); the loop then carries an `Observations` pytree
with just those fields (Random Attention needs nothing, so its loop state and compiled program
have no trace of them):
- `queries` [l, b, h, w, d]: the last w post-RoPE queries of every layer and query head, a ring
  indexed per row by `generated % w` (SnapKV, R-KV, VaSE, TOVA);
- `attention_sum` [l, b, k, s] float32: each slot's attention summed over steps and over the
  query heads of its KV head (H2O's heavy-hitter score). It moves with its slot at compaction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.models.bits import moved_as_bits
from randkv_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ScoringNeeds:
    query_window: int = 0
    """Keep the last `query_window` post-RoPE queries (0: none)."""
    attention_sum: bool = False
    """Accumulate per-slot attention (summed over the KV head's query group)."""

    @property
    def any(self) -> bool:
        return self.query_window > 0 or self.attention_sum


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Observations:
    queries: Float[Array, "l b h w d"] | None = None
    """Ring of the last w post-RoPE queries; a row's entry `generated % w` is written by the step
    that feeds its token number `generated` (0-based count of generated tokens in the buffer)."""
    attention_sum: Float[Array, "l b k s"] | None = None
    """Accumulated attention per slot (prefill and decode queries)."""

    @classmethod
    def create(cls, needs: ScoringNeeds, config: ModelConfig, batch: int, capacity: int, dtype: Any):
        """The observations `needs` asks for, or None when it asks for nothing."""
        if not needs.any:
            return None
        l, h, k, d = config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim
        return cls(
            queries=jnp.zeros((l, batch, h, needs.query_window, d), dtype) if needs.query_window else None,
            attention_sum=jnp.zeros((l, batch, k, capacity), jnp.float32) if needs.attention_sum else None,
        )


def slot_attention(q, keys, positions, query_positions) -> Float[Array, "b k t s"]:
    """Attention probabilities of queries [b, t, h, d] over one layer's slots, summed per KV head.

    keys [b, k, s, d], positions [b, k, s] (-1 empty), query_positions [b, t]. Dense over the
    capacity: only policies that need it (H2O) pay for it.
    """
    b, t, h, d = q.shape
    k = keys.shape[1]
    qg = q.reshape(b, t, k, h // k, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32) * d**-0.5
    visible = (positions[:, :, None, None, :] >= 0) & (
        positions[:, :, None, None, :] <= query_positions[:, None, None, :, None])
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jnp.where(visible, jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1), 0.0)
    return probs.sum(axis=2)


def record_decode(obs: Observations | None, layer, generated, active, q, keys, positions, query_positions):
    """Record one decode step's queries q [b, 1, h, d] (and attention) for `layer`.

    generated [b]: each row's generated count before this step (its ring index, modulo w);
    active [b]: rows generating this step (the others' accumulated attention is left alone; their
    ring may take garbage: a row's ring is reset when a request is inserted)."""
    if obs is None:
        return None
    queries, attention_sum = obs.queries, obs.attention_sum
    if queries is not None:
        rows = jnp.arange(q.shape[0])
        ring = generated % queries.shape[3]
        queries = moved_as_bits(lambda d, u: d.at[layer, rows, :, ring].set(u), queries, q[:, 0])
    if attention_sum is not None:
        probs = slot_attention(q, keys[layer], positions[layer], query_positions)[:, :, 0]
        attention_sum = attention_sum.at[layer].add(jnp.where(active[:, None, None], probs, 0.0))
    return dataclasses.replace(obs, queries=queries, attention_sum=attention_sum)


def record_prefill(obs: Observations | None, layer, q, k, token_positions):
    """Record the prompt's queries q [b, t, h, d] against its own keys k [b, t, kv, d]."""
    if obs is None or obs.attention_sum is None:
        return obs
    t = q.shape[1]
    positions = jnp.broadcast_to(token_positions[:, None, :], (k.shape[0], k.shape[2], t))
    probs = slot_attention(q, k.transpose(0, 2, 1, 3), positions, token_positions)  # [b, k, t, t]
    probs = jnp.where((token_positions >= 0)[:, None, :, None], probs, 0.0).sum(axis=2)  # real queries
    attention_sum = jax.lax.dynamic_update_slice(obs.attention_sum, probs[None], (layer, 0, 0, 0))
    return dataclasses.replace(obs, attention_sum=attention_sum)


def reorder(obs: Observations | None, order: Int[Array, "l b k s"], valid: Bool[Array, "l b k s"]):
    """Move per-slot observations with their slots: `order` is the permutation `buffer.compact`
    applied, `valid` the compacted buffer's valid slots (the others are zeroed)."""
    if obs is None or obs.attention_sum is None:
        return obs
    moved = jnp.take_along_axis(obs.attention_sum, order, axis=-1)
    return dataclasses.replace(obs, attention_sum=jnp.where(valid, moved, 0.0))


def insert_row(obs: Observations | None, slot: Int[Array, ""], prompt: Observations | None, row: Int[Array, ""]):
    """`obs` with row `slot` reset for a new request: an empty query ring, and the accumulated
    attention of row `row` of the prefill's observations `prompt` (zeros past its t slots)."""
    if obs is None:
        return None
    at = lambda dest, x: jax.lax.dynamic_update_slice(dest, x, (0, slot) + (0,) * (dest.ndim - 2))  # noqa: E731
    queries, attention_sum = obs.queries, obs.attention_sum
    if queries is not None:
        queries = at(queries, jnp.zeros((queries.shape[0], 1, *queries.shape[2:]), queries.dtype))
    if attention_sum is not None:
        fresh = jnp.zeros((attention_sum.shape[0], 1, *attention_sum.shape[2:]), jnp.float32)
        fresh = jax.lax.dynamic_update_slice(
            fresh, jax.lax.dynamic_slice_in_dim(prompt.attention_sum, row, 1, axis=1), (0, 0, 0, 0))
        attention_sum = at(attention_sum, fresh)
    return dataclasses.replace(obs, queries=queries, attention_sum=attention_sum)
