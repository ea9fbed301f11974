"""FullAttention: no eviction; the buffer holds the prompt and every generated token."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.observations import Observations, ScoringNeeds


@dataclasses.dataclass(frozen=True)
class FullAttention:
    """The `Policy` that is never due: every row keeps everything."""

    name: ClassVar[str] = "full"
    interval: ClassVar[int] = 1
    """No rounds to keep in step: a request may start at any decode step."""

    @property
    def needs(self) -> ScoringNeeds:
        return ScoringNeeds()

    def check_model(self, config) -> None:
        """Any model runs under full attention."""

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens

    def due(self, buffer: KVBuffer) -> Bool[Array, " b"]:
        return jnp.zeros(buffer.fill.shape, bool)

    def keep_mask(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None, *,
        platform: str,
    ) -> Bool[Array, "l b k s"]:
        return buffer.valid
