"""Random Attention (arXiv 2609.03430): keep the prompt, keep K random generated entries per head.

At every round each (layer, row, KV head) scores its eligible entries with fresh uniform draws
and keeps the K highest: K uniformly random entries, drawn independently per head, per layer
and per round. The draws come from `kernels.hash_prng.eviction_draws` on (seed, row seed,
layer, head, round, slot), so a request's keep-sets depend on its own seed only, never on the
batch it runs in. Controls from the paper:
  - `shared_across_heads`: one draw per layer, used by all its KV heads;
  - `block_size` B: one draw per block of B consecutive slots (slot // B).

`backend` picks who computes a round's keep mask (the same mask bit for bit either way):
  - "xla":    the shared `EvictionPolicy.keep_mask` (draws, then a stable argsort per head);
  - "pallas": the Pallas kernel `kernels.random_keep` (draws and a threshold bisection inside
              the kernel; Mosaic on TPU, Triton on GPU, interpret mode on CPU);
  - "auto":   Pallas when JAX's default backend is TPU or GPU, XLA on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.hash_prng import eviction_draws
from randkv_jax.kernels.random_keep import random_keep_mask
from randkv_jax.policies.base import EvictionPolicy, parse_protect

BACKENDS = ("auto", "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class RandomAttention(EvictionPolicy):
    name: ClassVar[str] = "random"
    seed: int = 0
    shared_across_heads: bool = False
    block_size: int = 1
    backend: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} ('auto': Pallas on TPU/GPU, XLA on CPU), "
                             f"got {self.backend!r}")

    def resolved_backend(self) -> str:
        """"pallas" or "xla": what `keep_mask` runs on the current default JAX backend."""
        if self.backend != "auto":
            return self.backend
        return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"

    def scores(
        self, buffer: KVBuffer, n_generated: Int[Array, ""], row_seeds: Int[Array, " b"], observations=None
    ) -> Float[Array, "l b k s"]:
        l, b, k, s = buffer.positions.shape
        layer = jnp.arange(l)[:, None, None, None]
        head = 0 if self.shared_across_heads else jnp.arange(k)[None, None, :, None]
        slot = jnp.arange(s)[None, None, None, :] // self.block_size
        round_index = n_generated // self.buffer
        draws = eviction_draws(self.seed, row_seeds[None, :, None, None], layer, head, round_index, slot)
        return jnp.broadcast_to(draws, (l, b, k, s)).astype(jnp.float32)

    def keep_mask(
        self, buffer: KVBuffer, n_generated: Int[Array, ""], row_seeds: Int[Array, " b"], observations=None
    ) -> Bool[Array, "l b k s"]:
        """The entries each layer/row/head keeps this round (all of them in rows not `due`)."""
        if self.resolved_backend() == "xla":
            return super().keep_mask(buffer, n_generated, row_seeds, observations)
        # rows not due keep every valid entry: a K of `capacity` keeps all eligible slots
        due = self.due(buffer, n_generated)
        kept = jnp.where(due, self.kept_per_row(buffer.prompt_lens), buffer.capacity)
        return random_keep_mask(
            buffer.positions, buffer.prompt_lens, kept, row_seeds, self.seed, n_generated,
            buffer=self.buffer, sinks=parse_protect(self.protect),
            shared_across_heads=self.shared_across_heads, block_size=self.block_size,
        )
