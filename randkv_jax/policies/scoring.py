"""Building blocks the scoring policies share: window attention, pooling, GQA reduction.

Everything here works on one layer ([b, ...]); policies map it over layers (`vmap`, or `lax.map`
to hold one layer's intermediates at a time). Shapes:
b rows, h query heads, k KV heads (h = k * g, query head h uses KV head h // g as transformers'
`repeat_kv` does), w window queries, s slots, d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def candidate_attention(
    queries: Float[Array, "b h w d"],
    keys: Float[Array, "b k s d"],
    candidates: Bool[Array, "b k s"],
    group_logits: str | None = None,
) -> Float[Array, "b hk w s"]:
    """softmax(q . k / sqrt(d)) of each window query over the candidate slots only (float32).

    Non-candidate slots get probability 0; the softmax of a query is normalised over its KV
    head's candidates (the engine's convention: the recency window is not a candidate).
    Result [b, h, w, s], one softmax per query head; with `group_logits="max"`, [b, k, w, s]:
    the logits are max-reduced over each KV head's query group before the softmax (R-KV's
    `compute_attention_scores(..., pooling="max")`).
    """
    b, h, w, d = queries.shape
    k = keys.shape[1]
    qg = queries.reshape(b, k, h // k, w, d)
    logits = jnp.einsum("bkgwd,bksd->bkgws", qg, keys, preferred_element_type=jnp.float32) * d**-0.5
    if group_logits == "max":
        logits = logits.max(axis=2, keepdims=True)
    elif group_logits is not None:
        raise ValueError(f"group_logits must be None or 'max', got {group_logits!r}")
    mask = candidates[:, :, None, None, :]
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.where(mask, probs, 0.0).reshape(b, -1, w, keys.shape[2])


def pool_slots(x: Float[Array, "... s"], kernel: int, mode: str) -> Float[Array, "... s"]:
    """1-D pooling along the slot axis with stride 1 and `kernel // 2` padding (same length).

    mode "avg": torch `avg_pool1d(..., padding=k//2)` (zero padding counted in the mean);
    mode "max": `max_pool1d(..., padding=k//2)` (padding never wins).
    """
    if kernel <= 1:
        return x
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    pad = kernel // 2
    window = (1,) * (x.ndim - 1) + (kernel,)
    padding = ((0, 0),) * (x.ndim - 1) + ((pad, pad),)
    if mode == "avg":
        summed = jax.lax.reduce_window(x, 0.0, jax.lax.add, window, (1,) * x.ndim, padding)
        return summed / kernel
    if mode == "max":
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, (1,) * x.ndim, padding)
    raise ValueError(f"pooling mode must be 'avg' or 'max', got {mode!r}")


def reduce_group(x: Float[Array, "b h ..."], kv_heads: int, mode: str) -> Float[Array, "b k ..."]:
    """Reduce query heads to their KV head: mean or max over each group of h // k heads."""
    b, h = x.shape[:2]
    grouped = x.reshape(b, kv_heads, h // kv_heads, *x.shape[2:])
    if mode == "mean":
        return grouped.mean(axis=2)
    if mode == "max":
        return grouped.max(axis=2)
    raise ValueError(f"group reduction must be 'mean' or 'max', got {mode!r}")

