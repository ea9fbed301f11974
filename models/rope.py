"""Rotary position embeddings: default, partial (Phi-3), linear, llama3, yarn and longrope.

Frequencies follow transformers' `modeling_rope_utils` formulas; everything is computed and
applied in float32 (rounding positions or angles to bfloat16 is catastrophic at long range).
The rotation is the non-interleaved "rotate half" form over the first `rotary_dim` dims of a head;
the remaining dims pass through unchanged (partial rotary).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from randkv_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, long: bool = False) -> tuple[np.ndarray, float]:
    """Return (inv_freq [rotary_dim // 2] float32, attention_scaling) for `config`.

    `long` selects longrope's long factors (used once a sequence passes the original context).
    """
    rope, dim = config.rope, config.rotary_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base_freq = np.float32(rope.theta) ** exponents  # [dim/2]
    inv_freq = (1.0 / base_freq).astype(np.float32)
    scaling = 1.0
    original_max = rope.original_max_position_embeddings or config.max_position_embeddings

    if rope.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        low_wavelen = original_max / rope.low_freq_factor
        high_wavelen = original_max / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (original_max / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rope.rope_type == "yarn":
        inv_freq, scaling = _yarn(inv_freq, base_freq, dim, rope, original_max)
    elif rope.rope_type == "longrope":
        factor = rope.factor or config.max_position_embeddings / original_max
        ext = np.asarray(rope.long_factor if long else rope.short_factor, np.float32)
        inv_freq = (1.0 / (ext * base_freq)).astype(np.float32)
        scaling = rope.attention_factor
        if scaling is None:
            scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    return inv_freq, float(scaling)


def _yarn(inv_freq, base_freq, dim, rope, original_max):
    factor = rope.factor
    scaling = rope.attention_factor
    if scaling is None:
        scaling = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations):
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (factor * base_freq)
    mixed = interpolated * (1 - extrapolation) + inv_freq * extrapolation
    return mixed.astype(np.float32), scaling


def rope_angles(
    config: ModelConfig, positions: Int[Array, "*batch t"]
) -> tuple[Float[Array, "*batch t r"], Float[Array, "*batch t r"]]:
    """cos and sin tables for `positions`, float32, `r = rotary_dim`, attention scaling folded in.

    Longrope picks its long factors when `max(positions) + 1` exceeds the original context,
    as transformers does (one choice for the whole call).
    """
    positions = positions.astype(jnp.float32)
    short_freq, scaling = inverse_frequencies(config)
    inv_freq = jnp.asarray(short_freq)
    if config.rope.rope_type == "longrope":
        long_freq, _ = inverse_frequencies(config, long=True)
        original_max = config.rope.original_max_position_embeddings
        use_long = jnp.max(positions) + 1 > original_max
        inv_freq = jnp.where(use_long, jnp.asarray(long_freq), inv_freq)
    angles = positions[..., None] * inv_freq  # [..., t, r/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scaling, jnp.sin(angles) * scaling


def apply_rope(
    x: Float[Array, "b t n d"], cos: Float[Array, "b t r"], sin: Float[Array, "b t r"]
) -> Float[Array, "b t n d"]:
    """Rotate the first r dims of every head of `x` (rotate-half form), in float32."""
    dtype, r = x.dtype, cos.shape[-1]
    x = x.astype(jnp.float32)
    rot, rest = x[..., :r], x[..., r:]
    first, second = rot[..., : r // 2], rot[..., r // 2 :]
    rotated_half = jnp.concatenate([-second, first], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)
    return out.astype(dtype)

