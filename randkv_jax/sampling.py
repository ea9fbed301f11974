"""Next-token sampling: greedy, temperature, top-k and top-p, one PRNG stream per request.

Each row draws from its own key, `fold_in(key(row_seed), n)` with n the row's own count of
generated tokens before this one, and rows are sampled
independently (`vmap`), so a request's tokens do not depend on the batch it runs in. The order of
the filters is transformers': temperature, then top-k, then top-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy (argmax); `top_k == 0` and `top_p == 1` switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: Float[Array, " v"], params: SamplingParams) -> Float[Array, " v"]:
    """Temperature-scaled logits with everything outside top-k / the top-p nucleus at -inf."""
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k:
        kth = jax.lax.top_k(logits, params.top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        order = jnp.argsort(-logits)
        sorted_probs = jax.nn.softmax(logits[order])
        # keep a token if the mass strictly before it is below top_p (so at least one is kept)
        mass_before = jnp.cumsum(sorted_probs) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample_tokens(
    logits: Float[Array, "b v"],
    row_keys: jax.Array,
    counts: Int[Array, " b"],
    params: SamplingParams,
) -> Int[Array, " b"]:
    """One token per row. `row_keys` [b] are the requests' base keys; each row's `counts` (its
    generated tokens so far) is folded into its key."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def one(row_logits, key, count):
        key = jax.random.fold_in(key, count)
        return jax.random.categorical(key, filter_logits(row_logits, params)).astype(jnp.int32)

    return jax.vmap(one)(logits, row_keys, counts)
