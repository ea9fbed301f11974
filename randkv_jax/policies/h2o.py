"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs"):
keep the heavy hitters (largest accumulated attention) plus a recent window.

Source: `FMInference/H2O h2o_hf/utils_real_drop/modify_llama.py` (`H2OKVCache_LayerWise`):
`hh_score` adds, at every forward pass, the attention each cached key receives, summed over the
pass's query positions (`attn_weights.sum(0).sum(1)`), per head; the prompt's own causal
attention is included (the cache is called from the prefill forward too), and the score moves
with its key when others are evicted. It then keeps `topk(hh_score)` of size `hh_size` among the
keys before the last `recent_size`, plus those `recent_size`.

Here: score = `Observations.attention_sum` [l, b, k, s], accumulated by the decode loop
(`randkv_jax.observations.slot_attention`, recorded for the prompt by `record_prefill`, for every
decode query by `record_decode`, moved with its slot by `reorder`). That function is H2O's score
as a pure function: the attention of queries [b, t, h, d] over one layer's slots, summed per KV
head -> [b, k, t, s]; summing over t and steps gives `hh_score`. Deviations, all documented:
  - keep-sets are per KV head, so the score of a slot sums the attention of the KV head's whole
    query group (the original is written for multi-head attention, one score per head);
  - hh_size = K_sel (budget - window, pinned entries included), recent_size = window, and rounds
    run on the shared rule (every `interval` generated tokens, see `randkv_jax.rule`) instead of
    evicting one token per step once over hh_size + recent_size;
  - a long prompt is not cut at prefill: its entries are evicted at rounds, if `protect` allows;
  - scores are per row (the original sums over the batch, assuming batch 1).
Default protect "none": the original protects nothing but the recent window.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxtyping import Array, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.base import EvictionPolicy


@dataclasses.dataclass(frozen=True)
class H2O(EvictionPolicy):
    name: ClassVar[str] = "h2o"
    protect: str = "none"

    @property
    def needs(self) -> ScoringNeeds:
        return ScoringNeeds(attention_sum=True)

    def scores(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None
    ) -> Float[Array, "l b k s"]:
        """The attention each slot has accumulated (prefill and decode queries, summed per KV head)."""
        if observations is None or observations.attention_sum is None:
            raise ValueError("H2O scores need observations with attention_sum (ScoringNeeds(attention_sum=True))")
        return observations.attention_sum
