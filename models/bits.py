"""Data movement of 16-bit floats as 16-bit integers (an XLA:CPU workaround, free elsewhere)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array


def is_half(dtype) -> bool:
    """Whether `dtype` is a 16-bit float (bfloat16, float16): the dtypes moved as bits."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def to_bits(x: Array) -> Array:
    """The uint16 bits of a 16-bit float array (the same data, a bitcast)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def from_bits(bits: Array, dtype) -> Array:
    """The 16-bit float `dtype` array whose bits are `bits` (uint16): the inverse of `to_bits`."""
    return jax.lax.bitcast_convert_type(bits, dtype)


def moved_as_bits(op: Callable[..., Array], x: Array, *updates: Array) -> Array:
    """`op(x, *updates)` for an op that only moves data (scatter, gather, update-slice); with a
    16-bit float `x` it runs on the bits (uint16, `updates` cast to `x.dtype` first).

    XLA:CPU's float normalization does not take 16-bit float scatters and gathers: it converts
    the operand, the *whole* buffer, to float32 and back around each one (measured on 2 CPU cores:
    30 per-layer appends to a bfloat16 [30, 8, 3, 640, 64] buffer, 4 steps, 1856 ms against 87 ms
    on the bits; the embedding lookup converted the whole table every step). The bits are the
    same data: no extra work on any backend.
    """
    if not is_half(x.dtype):
        return op(x, *(u.astype(x.dtype) for u in updates))
    return from_bits(op(to_bits(x), *(to_bits(u.astype(x.dtype)) for u in updates)), x.dtype)
