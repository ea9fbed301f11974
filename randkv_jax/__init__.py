"""randkv-jax: long reasoning generation with a bounded KV cache (Random Attention) in JAX."""

from randkv_jax.models.loading import load_model
from randkv_jax.models.model import Model

__all__ = ["Model", "load_model"]
