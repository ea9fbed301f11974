"""Head pinning on top of any eviction policy: the paper's planted-fact probe control.

`PinnedSpan(base, start, end, heads)` runs `base`'s rounds, except that the entries of absolute
positions [start, end) (the needle) are forced into the KV heads `heads` (global head numbers, all
layers) and out of every other head (the paper's `synth_pin`: +inf scores in the chosen heads,
-inf in the others). Everything else is `base`'s: the budget, window, interval, pinned prompt and
the scores of the other entries. Only candidates are affected: while the span is inside the
window every head holds it, as every head holds its window; a round after it leaves the window,
exactly the chosen heads hold it (as long as the selected part K_sel - pinned has room for it).

`heads=()` evicts the span from every head at its first round as a candidate (the probes'
"deleted" reference); all heads keeps it everywhere ("kept").
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.rule import select_top


@dataclasses.dataclass(frozen=True)
class PinnedSpan:
    name: ClassVar[str] = "pinned"
    base: EvictionPolicy
    """The policy whose rounds run (any `EvictionPolicy`: it must expose `scores`)."""
    start: int
    """First absolute position of the span."""
    end: int
    """One past its last position."""
    heads: tuple[int, ...] = ()
    """Global KV-head numbers that hold the span (in every layer); all others never do."""

    def __post_init__(self):
        if not isinstance(self.base, EvictionPolicy):
            raise ValueError(f"PinnedSpan needs an eviction policy, got {type(self.base).__name__}")
        if not (isinstance(self.start, int) and isinstance(self.end, int) and 0 <= self.start < self.end):
            raise ValueError(f"the span must satisfy 0 <= start < end, got [{self.start}, {self.end})")
        object.__setattr__(self, "heads", tuple(sorted({int(h) for h in self.heads})))
        if self.end - self.start >= self.base.selected:
            raise ValueError(f"a span of {self.end - self.start} positions does not fit the selected part "
                             f"K_sel = {self.base.selected} of {self.base}")

    @property
    def interval(self) -> int:
        return self.base.interval

    @property
    def rule(self):
        return self.base.rule

    @property
    def needs(self) -> ScoringNeeds:
        return self.base.needs

    @property
    def scores_across_heads(self) -> bool:
        return self.base.scores_across_heads

    def check_model(self, config) -> None:
        self.base.check_model(config)
        bad = [h for h in self.heads if not 0 <= h < config.num_kv_heads]
        if bad:
            raise ValueError(f"pinned heads {bad} do not exist: the model has {config.num_kv_heads} KV heads")

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.base.capacity(prompt_len, max_new_tokens)

    def due(self, buffer: KVBuffer) -> Bool[Array, " b"]:
        return self.base.due(buffer)

    def keep_mask(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None, *,
        platform: str,
    ) -> Bool[Array, "l b k s"]:
        masks = self.base.round_masks(buffer)
        scores = self.base.scores(buffer, row_seeds, observations)
        in_span = (buffer.positions >= self.start) & (buffer.positions < self.end)
        chosen = jnp.isin(buffer.head_ids, jnp.asarray(self.heads, jnp.int32))[None, None, :, None]
        eligible = masks.eligible & ~(in_span & ~chosen)
        scores = jnp.where(in_span & chosen, jnp.inf, scores)
        count = self.base.rule.n_select(buffer.prompt_lens)[None, :, None]
        keep = masks.protected | select_top(scores, eligible, count)
        return jnp.where(self.due(buffer)[None, :, None, None], keep, buffer.valid)
