"""Data movement of 16-bit floats as 16-bit integers (an XLA:CPU workaround, free elsewhere)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array


def moved_as_bits(op: Callable[..., Array], x: Array, *updates: Array) -> Array:
    """`op(x, *updates)` for an op that only moves data (scatter, gather, update-slice); with a
    16-bit float `x` it runs on the bits (uint16, `updates` cast to `x.dtype` first).

    XLA:CPU's float normalization does not take 16-bit float scatters and gathers: it converts
    the operand, the *whole* buffer, to float32 and back around each one (measured on 2 CPU cores:
    30 per-layer appends to a bfloat16 [30, 8, 3, 640, 64] buffer, 4 steps, 1856 ms against 87 ms
    on the bits; the embedding lookup converted the whole table every step). The bits are the
    same data: no extra work on any backend.
    """
    if not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2):
        return op(x, *(u.astype(x.dtype) for u in updates))
    bits = lambda a: jax.lax.bitcast_convert_type(a.astype(x.dtype), jnp.uint16)  # noqa: E731
    return jax.lax.bitcast_convert_type(op(bits(x), *map(bits, updates)), x.dtype)
