"""Random Attention (arXiv 2609.03430): pin the prompt, keep random entries per head for the rest.

At every round each (layer, row, KV head) scores its eligible entries with fresh uniform draws
and keeps the K_sel - pinned highest (see `randkv_jax.rule`): uniformly random entries, drawn
independently per head, per layer and per round. The draws come from
`kernels.hash_prng.eviction_draws` on (seed, row seed, layer, head, the row's generated count at
the round, slot), so a request's keep-sets depend on its own seed and count only, never on the
batch it runs in. Controls from the paper:
  - `shared_across_heads`: one draw per layer, used by all its KV heads (`random_unified`);
  - `slots_per_draw` B: one draw per block of B consecutive slots (slot // B; the paper's
    `random_block_pp`, env BLOCK_SIZE).

`backend` picks who computes a round's keep mask (the same mask bit for bit either way, and the
same as the shared `EvictionPolicy.keep_mask`, a stable argsort of the draws per head):
  - "xla":    the kernel's threshold bisection run by XLA over the whole [l, b, k, s] array
              (`random_keep_mask_reference(method="bisect")`): no sort (on 2 CPU cores, SmolLM2's
              30 layers x batch 8 x 3 KV heads x 640 slots: 3 ms against 132 ms for the argsort);
  - "pallas": the Pallas kernel `kernels.random_keep` (draws and the same bisection inside
              the kernel; Mosaic on TPU, Triton on GPU, interpret mode on CPU);
  - "auto":   Pallas when the decode program is built for TPU or GPU, XLA on CPU.
The platform comes from the decode spec (`DecodeSpec.platform`), resolved once before tracing.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.hash_prng import eviction_draws
from randkv_jax.kernels.random_keep import random_keep_mask, random_keep_mask_reference
from randkv_jax.policies.base import PLATFORMS, EvictionPolicy

BACKENDS = ("auto", "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class RandomAttention(EvictionPolicy):
    name: ClassVar[str] = "random"
    seed: int = 0
    """Global seed of the draws (combined with each row's seed)."""
    shared_across_heads: bool = False
    """One keep-set per layer for all KV heads (the paper's shared-draw control)."""
    slots_per_draw: int = 1
    """Consecutive slots sharing one draw (the paper's block-size ablation; 1 = per entry)."""
    backend: str = "auto"
    """"auto", "pallas" or "xla": who computes the keep mask (identical results)."""

    def _validate(self) -> None:
        if not isinstance(self.slots_per_draw, int) or self.slots_per_draw <= 0:
            raise ValueError(f"slots_per_draw must be a positive integer, got {self.slots_per_draw!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} ('auto': Pallas on TPU/GPU, XLA on CPU), "
                             f"got {self.backend!r}")

    def resolved_backend(self, platform: str) -> str:
        """"pallas" or "xla": what `keep_mask` runs for a program built for `platform`."""
        if platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
        if self.backend != "auto":
            return self.backend
        return "pallas" if platform in ("tpu", "gpu") else "xla"

    def scores(self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations=None) -> Float[Array, "l b k s"]:
        l, b, k, s = buffer.positions.shape
        layer = jnp.arange(l)[:, None, None, None]
        head = 0 if self.shared_across_heads else buffer.head_ids[None, None, :, None]
        slot = jnp.arange(s)[None, None, None, :] // self.slots_per_draw
        per_row = lambda x: x[None, :, None, None]  # noqa: E731
        draws = eviction_draws(self.seed, per_row(row_seeds), layer, head, per_row(buffer.generated), slot)
        return jnp.broadcast_to(draws, (l, b, k, s)).astype(jnp.float32)

    def keep_mask(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations=None, *, platform: str
    ) -> Bool[Array, "l b k s"]:
        # rows not due keep every valid entry: selecting `capacity` keeps all eligible slots
        n_select = jnp.where(self.due(buffer), self.rule.n_select(buffer.prompt_lens), buffer.capacity)
        draw_settings = dict(rule=self.rule, first_head=buffer.head_ids[0],
                             shared_across_heads=self.shared_across_heads, slots_per_draw=self.slots_per_draw)
        args = (buffer.positions, buffer.prompt_lens, buffer.generated, n_select, row_seeds, self.seed)
        if self.resolved_backend(platform) == "xla":
            return random_keep_mask_reference(*args, method="bisect", **draw_settings)
        return random_keep_mask(*args, platform="triton" if platform == "gpu" else "tpu", interpret=platform == "cpu",
                                **draw_settings)
