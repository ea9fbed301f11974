"""Attention over a fixed-shape KV buffer whose cost follows what is filled, not its capacity.

Per layer the buffer holds keys and values [b, k, s, d] (after RoPE) and the absolute token
position of every slot [b, k, s] int32 (-1 = empty). Heads may hold different positions, but the
valid slots of a row are a prefix [0, fill_b) of the slot axis (with possible -1 holes inside it),
so `n_filled = max_b fill_b` bounds what has to be read.

`buffer_attention` walks that prefix in fixed-size blocks of `block_size` slots with an online
softmax (flash-decoding style): `lax.fori_loop(0, ceil(n_filled / block_size))`, whose trip count
is traced (it lowers to a `while_loop`), so one compiled function serves every fill level and a
1k-filled 32k-slot buffer costs about what a 1k-slot buffer does.

Tail handling: `s` need not be a multiple of `block_size`. The last block's start is clamped to
`s - block_size` (so every `dynamic_slice` stays in bounds) and the slots it re-reads, which an
earlier block already covered, are masked out; slots at or past `n_filled` are masked too. Masked
slots contribute nothing even if their keys or values are NaN/inf (scores are selected away, values
zeroed), which is what makes "slots >= n_filled are never read" hold numerically. If `s <
block_size` the block is the whole buffer.

Einsum letters as in `models/decoder.py`: b batch, t query time, s key slot, h query heads,
k kv heads, g query heads per kv head (h = k * g + g_index, transformers' `repeat_kv`), d head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from randkv_jax.models.bits import from_bits, is_half

__all__ = ["buffer_attention"]


def _slice_slots(x: jax.Array, layer, start: jax.Array, size: int, bits_of) -> jax.Array:
    """`x[:, :, start:start + size]`, or `x[layer, :, :, start:start + size]` when `layer` is given;
    with `bits_of` (x holds the uint16 bits of that 16-bit float dtype) the block comes back in
    that dtype.

    Slicing the stacked [l, ...] buffer directly (rather than `x[layer]` first) reads only the
    block: no per-layer copy of the buffer is made. Why bits: XLA:CPU's float normalization does
    not take a 16-bit-float `dynamic-slice`: it converts the operand, the *whole* buffer, to float32,
    and loop-invariant code motion hoists that convert out of the loop, so every call pays for the
    capacity (measured: 298 ms instead of 5.5 ms per call at 1k filled / 16k slots, B=4, H=16,
    Hkv=8, D=128). The caller holds the buffer as bits (the decode loop does on CPU, where it also
    appends to them): a bitcast of the whole buffer inside the call would be materialised.
    """
    if layer is None:
        block = jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)
    else:
        index = (layer, 0, 0, start) + (0,) * (x.ndim - 4)
        block = jax.lax.dynamic_slice(x, index, (1, *x.shape[1:3], size, *x.shape[4:]))[0]
    return block if bits_of is None else from_bits(block, bits_of)


def buffer_attention(
    q: Float[Array, "b t h d"],
    keys: Float[Array, "b k s d"],
    values: Float[Array, "b k s d"],
    slot_positions: Int[Array, "b k s"],
    query_positions: Int[Array, "b t"],
    n_filled: Int[Array, ""] | int,
    *,
    block_size: int = 256,
    layer: Int[Array, ""] | None = None,
    bits_of: DTypeLike | None = None,
) -> Float[Array, "b t h d"]:
    """Softmax attention of `q` over the first `n_filled` slots of a KV buffer.

    Args:
      q: [b, t, h, d] queries (after RoPE); `t >= 1` (decode has t = 1).
      keys, values: [b, k, s, d] buffer, in the compute dtype (float32 or bfloat16), or its uint16
        bits with `bits_of`; `h % k == 0`.
      slot_positions: [b, k, s] int32 absolute position of each slot, -1 for an empty slot.
      query_positions: [b, t] int32 absolute position of each query token.
      n_filled: int32 scalar, may be traced: slots `>= n_filled` are never read (clipped to [0, s]).
      block_size: static number of slots per loop step (`min(block_size, s)` is used).
      layer: when given, `keys`/`values` are the stacked buffer [l, b, k, s, d] and
        `slot_positions` [l, b, k, s], and layer `layer` is read (the decode loop's case).
      bits_of: static; when given, a 16-bit float dtype (bfloat16, float16) of which `keys` and
        `values` hold the uint16 bits (`models.bits.to_bits`): each block is read as bits and
        bitcast back (the XLA:CPU workaround of `_slice_slots`).

    Returns:
      ctx [b, t, h, d] in `q.dtype`. Query t sees slot j of kv head k iff
      `0 <= slot_positions[b, k, j] <= query_positions[b, t]` and `j < n_filled`; a query that sees
      no slot gets zeros. Scores, running max / sum and the accumulator are float32; the
      probabilities are cast to the values' dtype for the second matmul (as in `causal_attend`).
    """
    stacked = layer is not None
    if stacked and (keys.ndim != 5 or values.shape != keys.shape or slot_positions.ndim != 4):
        raise ValueError(f"with layer=, keys/values must be [l, b, k, s, d]; got {keys.shape}")
    shape_of = (lambda x: x.shape[1:]) if stacked else (lambda x: x.shape)  # noqa: E731
    if q.ndim != 4 or len(shape_of(keys)) != 4:
        raise ValueError(f"q must be [b, t, h, d] and keys [b, k, s, d]; got {q.shape} and {keys.shape}")
    b, t, h, d = q.shape
    _, kv_heads, s, _ = shape_of(keys)
    if shape_of(keys)[0] != b or shape_of(keys)[3] != d:
        raise ValueError(f"keys {keys.shape} do not match q {q.shape} in batch or head dim")
    if values.shape != keys.shape:
        raise ValueError(f"values {values.shape} must have the shape of keys {keys.shape}")
    if shape_of(slot_positions) != (b, kv_heads, s):
        raise ValueError(f"slot_positions must be {(b, kv_heads, s)}, got {slot_positions.shape}")
    if query_positions.shape != (b, t):
        raise ValueError(f"query_positions must be {(b, t)}, got {query_positions.shape}")
    if kv_heads == 0 or h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kv_heads})")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if jnp.ndim(n_filled) != 0:
        raise ValueError(f"n_filled must be a scalar, got shape {jnp.shape(n_filled)}")
    if bits_of is not None and not (is_half(bits_of) and keys.dtype == jnp.uint16):
        raise ValueError(f"bits_of={bits_of} needs a 16-bit float dtype and uint16 keys/values, got {keys.dtype}")

    groups = h // kv_heads
    with jax.named_scope("buffer_attention"):
        if s == 0:
            return jnp.zeros_like(q)
        bs = min(block_size, s)
        n = jnp.clip(jnp.asarray(n_filled, jnp.int32), 0, s)
        num_blocks = (n + (bs - 1)) // bs

        qg = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)  # [b, k, g, t, d]
        qpos = query_positions.astype(jnp.int32)[:, None, None, :, None]  # [b, 1, 1, t, 1]
        scale = 1.0 / math.sqrt(d)
        offsets = jnp.arange(bs, dtype=jnp.int32)

        def body(i, carry):
            m, l, acc = carry
            nominal = i * bs
            start = jnp.minimum(nominal, s - bs)  # the tail block re-reads a few covered slots
            k_blk = _slice_slots(keys, layer, start, bs, bits_of)  # [b, k, bs, d]
            v_blk = _slice_slots(values, layer, start, bs, bits_of)
            pos = _slice_slots(slot_positions, layer, start, bs, None)  # [b, k, bs]
            idx = start + offsets
            live = ((idx >= nominal) & (idx < n))[None, None, :] & (pos >= 0)  # [b, k, bs]
            visible = live[:, :, None, None, :] & (pos[:, :, None, None, :] <= qpos)  # [b,k,1,t,bs]

            scores = jnp.einsum("bkgtd,bksd->bkgts", qg, k_blk, preferred_element_type=jnp.float32)
            scores = jnp.where(visible, scores * scale, -jnp.inf)
            m_new = jnp.maximum(m, scores.max(axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no visible slot yet: avoid inf - inf
            p = jnp.where(visible, jnp.exp(scores - m_safe[..., None]), 0.0)
            alpha = jnp.exp(m - m_safe)  # 0 while m is -inf
            v_blk = jnp.where(live[..., None], v_blk, jnp.zeros((), v_blk.dtype))  # NaN-proof
            pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

        init = (
            jnp.full((b, kv_heads, groups, t), -jnp.inf, jnp.float32),
            jnp.zeros((b, kv_heads, groups, t), jnp.float32),
            jnp.zeros((b, kv_heads, groups, t, d), jnp.float32),
        )
        _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
        ctx = acc / jnp.where(l > 0, l, 1.0)[..., None]  # acc is 0 where nothing was visible
        return ctx.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
