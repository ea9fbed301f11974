"""What an eviction policy is, and the selection step every scoring rule shares.

A policy decides, at each eviction round, which entries of the KV buffer each (layer, row, KV
head) keeps. Every policy here shares the same skeleton (the paper's engine):

- a round runs every `buffer` (r) generated tokens, for a row whose evictable entries exceed
  its budget K;
- protected entries are always kept: the recency window (the r newest tokens) and, by
  `protect`, the whole prompt ("prompt"), its first N tokens ("sinks:N") or nothing ("none");
- among the other entries ("eligible"), the K with the highest scores are kept, ties going to
  the older slot; kept entries stay in chronological order (`buffer.compact`).

Subclasses only say how to score eligible entries (`scores`) and what they need to observe
during decoding (`needs`: recent queries, accumulated attention; see `randkv_jax.observations`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.observations import Observations, ScoringNeeds

CONVENTIONS = ("text", "engine", "vllm")


def parse_protect(protect: str) -> int | None:
    """"prompt" -> None (whole prompt), "none" -> 0, "sinks:N" -> N."""
    if protect == "prompt":
        return None
    if protect == "none":
        return 0
    if protect.startswith("sinks:") and protect[6:].isdigit() and int(protect[6:]) > 0:
        return int(protect[6:])
    raise ValueError(f"protect must be 'prompt', 'none' or 'sinks:N' with N > 0, got {protect!r}")


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """Budget K, recency buffer r, prompt protection; see the module docstring.

    `convention` says what `budget` counts (the paper uses three; see docs/policies.md):
      - "text":   budget = K, the persistently kept generated entries (the paper's text:
                  "a persistent budget of K plus a buffer of r");
      - "engine": budget = the released engine's `token_budget` T = K + r, so K = T - r;
      - "vllm":   budget counts the prompt and the window too (the vLLM plugin's KV_BUDGET):
                  K = budget - prompt_len - r for each row (0 when the prompt alone fills it).
    """

    name: ClassVar[str] = "eviction"
    budget: int = 1024
    buffer: int = 64
    protect: str = "prompt"
    convention: str = "text"

    def __post_init__(self):
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise ValueError(f"{type(self).__name__}: budget must be a positive integer, got {self.budget!r}")
        if not isinstance(self.buffer, int) or self.buffer <= 0:
            raise ValueError(f"{type(self).__name__}: buffer must be a positive integer, got {self.buffer!r}")
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {self.convention!r}")
        if self.convention == "engine" and self.budget <= self.buffer:
            raise ValueError(f"engine convention: token_budget {self.budget} must exceed buffer {self.buffer}")
        parse_protect(self.protect)

    def check_model(self, config) -> None:
        """Raise ValueError if this policy cannot run on a model with `config` (default: it can)."""

    @property
    def needs(self) -> ScoringNeeds:
        """What the decode loop must record for `scores` (nothing, by default)."""
        return ScoringNeeds()

    @property
    def max_kept(self) -> int:
        """An upper bound of K over rows (static; sizes the buffer)."""
        return self.budget - self.buffer if self.convention in ("engine", "vllm") else self.budget

    def kept_per_row(self, prompt_lens: Int[Array, " b"]) -> Int[Array, " b"]:
        """K for each row."""
        if self.convention == "vllm":
            return jnp.maximum(self.budget - prompt_lens - self.buffer, 0)
        return jnp.full_like(prompt_lens, self.max_kept)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots a row needs: prompt + K + 2r (never more than prompt + max_new_tokens)."""
        return prompt_len + min(max_new_tokens, self.max_kept + 2 * self.buffer)

    def protected(self, buffer: KVBuffer, n_generated: Int[Array, ""]) -> Bool[Array, "l b k s"]:
        """Entries no round may evict: the prompt (per `protect`) and the r newest tokens."""
        pos, prompt = buffer.positions, buffer.prompt_lens[None, :, None, None]
        sinks = parse_protect(self.protect)
        kept_prompt = pos < prompt if sinks is None else pos < jnp.minimum(sinks, prompt)
        window = pos >= prompt + n_generated - self.buffer
        return buffer.valid & (kept_prompt | window)

    def due(self, buffer: KVBuffer, n_generated: Int[Array, ""]) -> Bool[Array, " b"]:
        """Rows for which a round runs now: a multiple of r generated, more than K eligible."""
        # every layer and head of a row holds as many eligible entries: count on one of them
        # (this runs at every decode step, so it must not touch the whole [l, b, k, s] array)
        one_head = dataclasses.replace(buffer, positions=buffer.positions[:1, :, :1])
        eligible = one_head.valid & ~self.protected(one_head, n_generated)
        n_eligible = jnp.sum(eligible[0, :, 0], axis=-1)
        on_boundary = (n_generated > 0) & (n_generated % self.buffer == 0)
        return on_boundary & (n_eligible > self.kept_per_row(buffer.prompt_lens))

    def keep_mask(
        self,
        buffer: KVBuffer,
        n_generated: Int[Array, ""],
        row_seeds: Int[Array, " b"],
        observations: Observations | None = None,
    ) -> Bool[Array, "l b k s"]:
        """The entries each layer/row/head keeps this round (all of them in rows not `due`)."""
        protected = self.protected(buffer, n_generated)
        eligible = buffer.valid & ~protected
        scores = self.scores(buffer, n_generated, row_seeds, observations)
        keep = protected | select_top(scores, eligible, self.kept_per_row(buffer.prompt_lens))
        return jnp.where(self.due(buffer, n_generated)[None, :, None, None], keep, buffer.valid)

    def scores(
        self,
        buffer: KVBuffer,
        n_generated: Int[Array, ""],
        row_seeds: Int[Array, " b"],
        observations: Observations | None = None,
    ) -> Float[Array, "l b k s"]:
        """A score per slot (higher is kept first); only eligible slots' scores matter."""
        raise NotImplementedError


def select_top(
    scores: Float[Array, "l b k s"], eligible: Bool[Array, "l b k s"], k: Int[Array, " b"]
) -> Bool[Array, "l b k s"]:
    """The k[b] highest-scoring eligible slots of each (layer, row, head); ties -> lower slot.

    Eligible slots rank before all others whatever their score (even -inf), so every head keeps
    exactly min(k, eligible) of them.
    """
    order = jnp.lexsort((-scores.astype(jnp.float32), ~eligible), axis=-1)  # stable: ties by slot
    rank = jnp.argsort(order, axis=-1)  # rank of each slot in that order
    return eligible & (rank < k[None, :, None, None])
