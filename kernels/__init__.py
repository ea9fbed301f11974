"""Pallas kernels: Random Attention's eviction round (`random_keep`) and its hash PRNG (`hash_prng`)."""

from randkv_jax.kernels.hash_prng import eviction_draws
from randkv_jax.kernels.random_keep import random_keep_mask, random_keep_mask_reference

__all__ = ["eviction_draws", "random_keep_mask", "random_keep_mask_reference"]
