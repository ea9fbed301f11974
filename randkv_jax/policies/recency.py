"""Recency: keep the most recent eligible entries (the paper's "Recency window" control).

Score = the entry's absolute position (newer = higher), so a round keeps the protected entries
plus the newest eligible ones: with protect="none" that is the newest T (= budget) tokens of the
sequence. The Random Attention paper's Table 2 reports this row unprotected (.246) and with
the prompt protected (.843); the default here is the unprotected control ("none").
`StreamingLLM` (streaming.py) is this rule with the first 4 tokens protected.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.policies.base import EvictionPolicy


def recency_scores(positions: Int[Array, "*batch s"]) -> Float[Array, "*batch s"]:
    """Each slot's absolute position as a float32 score (any leading shape; empty slots -1)."""
    return positions.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Recency(EvictionPolicy):
    name: ClassVar[str] = "recency"
    protect: str = "none"

    def scores(self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations=None) -> Float[Array, "l b k s"]:
        return recency_scores(buffer.positions)
