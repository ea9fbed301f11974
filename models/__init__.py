"""Flax decoders for Qwen3, Phi-3/Phi-4 and Llama; configs, conversion and tokenizers."""

from randkv_jax.models.config import ConfigError, ModelConfig, read_hf_config
from randkv_jax.models.model import Model, abstract_params, forward, init_params

__all__ = ["ConfigError", "Model", "ModelConfig", "abstract_params", "forward", "init_params", "read_hf_config"]
