"""A counter-based uint32 hash: the randomness of Random Attention's eviction draws.

`eviction_draws(seed, row_seed, layer, head, round, slot)` is a pure function of its counters,
built from uint32 multiply / xor / shift only (murmur3's `fmix32` finalizer, chained over the
counters), so the same numbers come out of plain jnp, a Pallas kernel in interpret mode, and a
kernel compiled for TPU (Mosaic) or GPU (Triton), where neither `jax.random` nor the TPU hardware
PRNG is available. Every (request, layer, KV head, round, slot) gets its own value: draws are
fresh each round and independent across heads and layers.

The draw is the top 24 bits, an integer in [0, 2^24): exactly representable in float32. Selection
ranks draws high to low; equal draws are ordered by slot, the lower (older) slot first.
`open_uniform` turns a draw into a float32 in the open interval (0, 1), for noise that goes
through a logarithm (VaSE's Gumbel draws, TriAttention's tie-break).
"""

from __future__ import annotations

import jax.numpy as jnp

DRAW_BITS = 24
_GOLDEN = 0x9E3779B9
_COUNTER_MULTIPLIERS = (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1, 0xD3A2646C)


def fmix32(h):
    """murmur3's 32-bit finalizer (full avalanche) on uint32 arrays."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def open_uniform(draws):
    """Draws -> float32 uniforms on (0, 1), exactly: (draw // 2 + 1/2) / 2^23.

    The top 23 bits keep `+ 1/2` exact in float32 (24 significant bits), so no value rounds to 0
    or 1 (the largest is 1 - 2^-24): -log(-log(u)) stays finite. (`draw + 1/2` over 24 bits would
    round half the draws and send the largest to exactly 1.0.)"""
    half = (jnp.asarray(draws).astype(jnp.uint32) >> 1).astype(jnp.float32)
    return (half + 0.5) / 2.0 ** (DRAW_BITS - 1)


def eviction_draws(seed, row_seed, layer, head, round_index, slot):
    """Draw in [0, 2^24) (uint32) for each broadcast combination of the integer counters.

    `round_index` identifies the round: the policies pass the row's generated count at it."""
    u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)  # noqa: E731 (wraps negatives mod 2^32)
    h = fmix32(u32(seed) * jnp.uint32(_GOLDEN) + jnp.uint32(0x632BE5AB))
    for counter, multiplier in zip((row_seed, layer, head, round_index, slot), _COUNTER_MULTIPLIERS):
        h = fmix32(h ^ (u32(counter) * jnp.uint32(multiplier) + jnp.uint32(_GOLDEN)))
    return h >> (32 - DRAW_BITS)
