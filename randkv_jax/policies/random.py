"""Random Attention (arXiv 2609.03430): keep the prompt, keep K random generated entries per head.

At every round each (layer, row, KV head) scores its eligible entries with fresh uniform draws
and keeps the K highest: K uniformly random entries, drawn independently per head, per layer
and per round. The draws come from `kernels.hash_prng.eviction_draws` on (seed, row seed,
layer, head, round, slot), so a request's keep-sets depend on its own seed only, never on the
batch it runs in. Controls from the paper:
  - `shared_across_heads`: one draw per layer, used by all its KV heads;
  - `block_size` B: one draw per block of B consecutive slots (slot // B).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.hash_prng import eviction_draws
from randkv_jax.policies.base import EvictionPolicy


@dataclasses.dataclass(frozen=True)
class RandomAttention(EvictionPolicy):
    name: ClassVar[str] = "random"
    seed: int = 0
    shared_across_heads: bool = False
    block_size: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")

    def scores(
        self, buffer: KVBuffer, n_generated: Int[Array, ""], row_seeds: Int[Array, " b"]
    ) -> Float[Array, "l b k s"]:
        l, b, k, s = buffer.positions.shape
        layer = jnp.arange(l)[:, None, None, None]
        head = 0 if self.shared_across_heads else jnp.arange(k)[None, None, :, None]
        slot = jnp.arange(s)[None, None, None, :] // self.block_size
        round_index = n_generated // self.buffer
        draws = eviction_draws(self.seed, row_seeds[None, :, None, None], layer, head, round_index, slot)
        return jnp.broadcast_to(draws, (l, b, k, s)).astype(jnp.float32)
