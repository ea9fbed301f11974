"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the entries the newest
query attends to most, averaged over the layer's heads.

Source: `schwartz-lab-NLP/TOVA src/tova_cache.py` (`TOVACache.reduce`): once a layer holds more
than `cache_size` keys, `mean(attn_weights[:, :, -1, :], dim=heads)` (the last query's attention
as the model computed it, over every cached key, the new one included, averaged over all query
heads), then `topk(cache_size)`; the same indices are gathered for every KV head.

Here: score = `tova_scores`, the last decode query (`ScoringNeeds(query_window=1)`) against each
layer's valid slots, softmax per query head over all valid slots (the model's own attention; not
the engine's window-excluded candidates, since TOVA ranks by the attention actually paid), mean
over all query heads; one score per slot for the whole layer, so every KV head keeps the same
slots. That relies on slot i holding the same token in every KV head of a layer, which holds as
long as all keep-sets are per layer (prefill writes the same positions to every head).
Deviations, documented: the original evicts one token per step once over `cache_size`; here
rounds run on the shared rule (every `interval` generated tokens, down to `budget` entries with
the window kept, see `randkv_jax.rule`), as the comparison requires of every policy. Default protect
"none", as in the original.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.policies.scoring import candidate_attention


def tova_scores(
    query: Float[Array, "b h d"], keys: Float[Array, "b k s d"], valid: Bool[Array, "b k s"]
) -> Float[Array, "b k s"]:
    """One layer: the query's attention over the valid slots, averaged over all h query heads.

    The result is the same for every KV head (broadcast to [b, k, s]); invalid slots score 0.
    """
    probs = candidate_attention(query[:, :, None], keys, valid)[:, :, 0]  # [b, h, s]
    return jnp.broadcast_to(probs.mean(axis=1)[:, None], valid.shape)


@dataclasses.dataclass(frozen=True)
class TOVA(EvictionPolicy):
    name: ClassVar[str] = "tova"
    scores_across_heads: ClassVar[bool] = True
    protect: str = "none"

    @property
    def needs(self) -> ScoringNeeds:
        return ScoringNeeds(query_window=1)

    def scores(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None
    ) -> Float[Array, "l b k s"]:
        if observations is None or observations.queries is None:
            raise ValueError("TOVA scores need observations with queries (ScoringNeeds(query_window=1))")
        last = observations.queries[:, :, :, -1]  # [l, b, h, d]: a window of 1 holds the newest query
        return jax.vmap(tova_scores)(last, buffer.keys, buffer.valid)
