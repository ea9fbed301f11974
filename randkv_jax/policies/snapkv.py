"""SnapKV (Li et al., 2024, arXiv 2404.14469) as a decode-time eviction policy: keep the entries
the most recent queries attend to, smoothed along the sequence.

score_j = reduce_group( pool_j( mean over the q window queries of softmax_j(q . k_j / sqrt(d)) ) ),
the softmax running over the candidate slots only (every valid slot outside the policy's window,
as the engine does: pinned prompt entries included, `RoundMasks.candidates`). Two presets:

- "paper": the Random Attention engine's `attn --smooth` mode, the paper's grid
  (`SalesforceAIResearch/Random-Attention kvcompress/engine/cache_utils.py`,
  `compute_attention_scores`, derived from VaSE's engine): q = the policy's interval i, i.e. the
  queries since the last round (the engine's query buffer holds the last `residual_length`
  queries, and there window = interval = residual_length), softmax per query head, mean over the window,
  `avg_pool1d(kernel 5, padding 2)` per query head (zero padding counted), mean over the KV
  head's query group. The paper's text calls SnapKV "max-pooled"; its code average-pools
  (kernel 5, citing kvpress `snapkv_press.py`); this preset follows the code.
- "rkv-repo": the decode-time SnapKV of the R-KV repository (`Zefan-Cai/R-KV
  rkv/compression/snapkv.py` with `rkv/utils.py compute_attention_scores(pooling="max")`):
  w = 8, logits max-reduced over the query group before the softmax, mean over the window,
  `max_pool1d(kernel 7, padding 3)` per KV head.

The original SnapKV (`FasterDecoding/SnapKV`) compresses the prompt once at prefill; both
presets are its decode-time ports. In both, the candidates exclude the recency window
(R-KV's code excludes its 8 window keys: its window and recency buffer coincide). Neither
forces sinks or the prompt: default protect "none". Rounds run on the shared rule
(`randkv_jax.rule`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.policies.scoring import candidate_attention, pool_slots, reduce_group


@dataclasses.dataclass(frozen=True)
class WindowAttention:
    """How a query-window attention score is computed (a SnapKV preset)."""

    queries: int | None
    """Window queries; None: the policy's interval (the queries since the last round)."""
    kernel: int
    """Pooling kernel along the slots (odd)."""
    pool: str
    """"avg" or "max" pooling."""
    group: str
    """"mean": softmax and pooling per query head, then mean over the group (engine);
    "max_logits": logits max-reduced over the group before the softmax (R-KV repo)."""


SNAPKV_PRESETS = {
    "paper": WindowAttention(queries=None, kernel=5, pool="avg", group="mean"),
    "rkv-repo": WindowAttention(queries=8, kernel=7, pool="max", group="max_logits"),
}


def snapkv_scores(
    queries: Float[Array, "b h w d"],
    keys: Float[Array, "b k s d"],
    candidates: Bool[Array, "b k s"],
    *,
    kernel: int,
    pool: str,
    group: str,
) -> Float[Array, "b k s"]:
    """One layer's SnapKV score per KV head and slot (float32); non-candidates pool as zeros.

    queries [b, h, w, d]: the window queries (order irrelevant); keys [b, k, s, d] post-RoPE;
    candidates [b, k, s]: the slots the softmax runs over.
    """
    k = keys.shape[1]
    if group == "mean":
        probs = candidate_attention(queries, keys, candidates).mean(axis=2)  # [b, h, s]
        return reduce_group(pool_slots(probs, kernel, pool), k, "mean")
    if group == "max_logits":
        probs = candidate_attention(queries, keys, candidates, group_logits="max").mean(axis=2)  # [b, k, s]
        return pool_slots(probs, kernel, pool)
    raise ValueError(f"group must be 'mean' or 'max_logits', got {group!r}")


def query_window(settings: WindowAttention, policy: EvictionPolicy) -> int:
    """The preset's number of window queries for `policy`; it must fit in the interval (the ring
    is full at every round only if at least that many steps ran since the last one)."""
    queries = policy.interval if settings.queries is None else settings.queries
    if queries > policy.interval:
        raise ValueError(f"{type(policy).__name__}: query window {queries} exceeds the interval "
                         f"i={policy.interval}; rounds run every i steps, so the window would hold unwritten queries")
    return queries


@dataclasses.dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    name: ClassVar[str] = "snapkv"
    protect: str = "none"
    preset: str = "paper"
    """A key of `SNAPKV_PRESETS`: "paper" (engine `attn --smooth`) or "rkv-repo"."""

    def _validate(self) -> None:
        if self.preset not in SNAPKV_PRESETS:
            raise ValueError(f"SnapKV preset must be one of {sorted(SNAPKV_PRESETS)}, got {self.preset!r}")
        query_window(self.settings, self)

    @property
    def settings(self) -> WindowAttention:
        return SNAPKV_PRESETS[self.preset]

    @property
    def needs(self) -> ScoringNeeds:
        return ScoringNeeds(query_window=query_window(self.settings, self))

    def scores(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None
    ) -> Float[Array, "l b k s"]:
        """`snapkv_scores` of every layer, from the observed query window (one layer at a time, so
        a round holds one layer's [b, h, q, s] attention)."""
        if observations is None or observations.queries is None:
            raise ValueError("SnapKV needs observations with queries (its `needs`)")
        s = self.settings
        score = lambda x: snapkv_scores(*x, kernel=s.kernel, pool=s.pool, group=s.group)  # noqa: E731
        return jax.lax.map(score, (observations.queries, buffer.keys, self.round_masks(buffer).candidates))
