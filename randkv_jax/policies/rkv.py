"""R-KV (Cai et al., 2025, arXiv 2505.24133): keep entries that are attended to and not redundant.

score_j = lambda * importance_j - (1 - lambda) * redundancy_j, with
  importance = the SnapKV window score (`snapkv.snapkv_scores`, per the preset),
  redundancy_j = softmax_j( mean_i C_ij ),  C_ij = k^_i . k^_j,  k^ = k / (||k|| + 1e-8),
over the candidate keys only (valid slots outside the recency window, `RoundMasks.candidates`),
per row, layer and KV head, with C_ii = 0. Two presets:

- "paper": the Random Attention engine's `attn_rkv --rkv_lambda 0.5 --smooth`, the paper's grid
  (`SalesforceAIResearch/Random-Attention kvcompress/engine/cache_utils.py`, `cal_redundancy`):
  importance = SnapKV "paper" (the interval's queries, per-head softmax, avg-pool 5, group mean), lambda = 0.5,
  no similarity threshold.
- "official": the R-KV repository (`Zefan-Cai/R-KV rkv/compression/r1_kv.py`, `rkv/utils.py
  cal_similarity`; lambda 0.1 from `HuggingFace/run_math.py` and the engine's `rkv_official`
  port): importance = SnapKV "rkv-repo" (w = 8, logits max over the group, max-pool 7),
  lambda = 0.1, and the threshold rule with `retain_direction="last"`: for each row i, the
  largest j with C_ij > 0.5 (the newest similar copy) gets C_ij = 0; a row with no such j
  zeroes its first column, as `max(where(mask, arange, 0))` does in the original.
  Each row uses its own keys, as the newer `HuggingFace/rkv/utils.py` does; the older
  `rkv/utils.py` computes the redundancy for batch row 0 only (`key_states[0]`) and applies it
  to every row (a deviation from that version). The original's similarity matrix also spans
  its 8 window keys (sliced off after the softmax); here, as in the engine's `rkv_official`
  port, only candidate keys enter it.

The original R-KV budget counts the prompt and protects nothing but the window: default protect
"none" (the engine's `attn_rkv` forces nothing either). Rounds use the shared rule.
Layers are scored one at a time (`lax.map`): the threshold rule needs the s x s similarity
matrix of each (row, KV head); without a threshold, sum_i C_ij = k^_j . sum_i k^_i - C_jj
avoids forming it.
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
from randkv_jax.policies.snapkv import SNAPKV_PRESETS, WindowAttention, query_window, snapkv_scores


@dataclasses.dataclass(frozen=True)
class RKVSettings:
    attention: WindowAttention
    """How the importance term is computed."""
    mix_lambda: float
    """Weight of importance (1 - lambda weighs redundancy)."""
    threshold: float | None
    """Similarity above which the newest similar key of each row is spared (None: no rule)."""


RKV_PRESETS = {
    "paper": RKVSettings(SNAPKV_PRESETS["paper"], mix_lambda=0.5, threshold=None),
    "official": RKVSettings(SNAPKV_PRESETS["rkv-repo"], mix_lambda=0.1, threshold=0.5),
}


def redundancy(
    keys: Float[Array, "b k s d"], candidates: Bool[Array, "b k s"], threshold: float | None
) -> Float[Array, "b k s"]:
    """softmax_j(mean_i C_ij) over candidates i, j (C: cosine similarity, zero diagonal); 0 elsewhere.

    With a threshold, row i first zeroes C[i, j*] for j* = the largest candidate j with
    C_ij > threshold (or the first candidate when there is none: R-KV's `retain_direction="last"`).
    """
    k = keys.astype(jnp.float32)
    unit = jnp.where(candidates[..., None], k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + 1e-8), 0.0)
    n = jnp.maximum(jnp.sum(candidates, axis=-1, keepdims=True), 1)
    self_similarity = jnp.sum(unit * unit, axis=-1)
    if threshold is None:  # sum_i C_ij without forming C: k^_j . sum_i k^_i, minus the diagonal
        column_sum = jnp.einsum("bksd,bkd->bks", unit, unit.sum(axis=2)) - self_similarity
    else:
        s = keys.shape[2]
        sim = jnp.einsum("bkid,bkjd->bkij", unit, unit) * (1.0 - jnp.eye(s, dtype=jnp.float32))
        slot = jnp.arange(s)
        similar = (sim > threshold) & candidates[:, :, None, :]
        newest = jnp.max(jnp.where(similar, slot, -1), axis=-1)  # [b, k, i]
        first = jnp.argmax(candidates, axis=-1)[..., None]  # [b, k, 1]
        spare = jnp.where(newest >= 0, newest, first)
        sim = jnp.where(slot == spare[..., None], 0.0, sim)
        column_sum = jnp.sum(jnp.where(candidates[..., None], sim, 0.0), axis=-2)  # over rows i
    logits = jnp.where(candidates, column_sum / n, -jnp.inf)
    return jnp.where(candidates, jax.nn.softmax(logits, axis=-1), 0.0)


def rkv_scores(
    queries: Float[Array, "b h w d"],
    keys: Float[Array, "b k s d"],
    candidates: Bool[Array, "b k s"],
    settings: RKVSettings,
) -> Float[Array, "b k s"]:
    """One layer's R-KV score: lambda * SnapKV importance - (1 - lambda) * redundancy."""
    a = settings.attention
    importance = snapkv_scores(queries, keys, candidates, kernel=a.kernel, pool=a.pool, group=a.group)
    lam = settings.mix_lambda
    return lam * importance - (1.0 - lam) * redundancy(keys, candidates, settings.threshold)


@dataclasses.dataclass(frozen=True)
class RKV(EvictionPolicy):
    name: ClassVar[str] = "rkv"
    protect: str = "none"
    preset: str = "paper"
    """A key of `RKV_PRESETS`: "paper" (engine `attn_rkv`, lambda 0.5) or "official" (R-KV repo)."""

    def _validate(self) -> None:
        if self.preset not in RKV_PRESETS:
            raise ValueError(f"RKV preset must be one of {sorted(RKV_PRESETS)}, got {self.preset!r}")
        query_window(self.settings.attention, self)

    @property
    def settings(self) -> RKVSettings:
        return RKV_PRESETS[self.preset]

    @property
    def needs(self) -> ScoringNeeds:
        return ScoringNeeds(query_window=query_window(self.settings.attention, self))

    def scores(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None
    ) -> Float[Array, "l b k s"]:
        if observations is None or observations.queries is None:
            raise ValueError("RKV needs observations with queries (its `needs`)")
        candidates = self.round_masks(buffer).candidates
        return jax.lax.map(
            lambda x: rkv_scores(*x, self.settings), (observations.queries, buffer.keys, candidates)
        )
