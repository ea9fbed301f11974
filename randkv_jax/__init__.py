"""randkv-jax: long reasoning generation with a bounded KV cache (Random Attention) in JAX."""

from randkv_jax import policies
from randkv_jax.engine import Completion, Engine, RowStats
from randkv_jax.generate import GenerationResult, generate
from randkv_jax.models.loading import load_model
from randkv_jax.models.model import Model
from randkv_jax.policies import FullAttention, RandomAttention

__all__ = [
    "Completion", "Engine", "FullAttention", "GenerationResult", "Model", "RandomAttention", "RowStats", "generate",
    "load_model", "policies",
]
