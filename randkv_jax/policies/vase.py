"""VaSE (arXiv 2606.03928): keep the entries with the largest value range, then sample the rest in
proportion to their attention.

Source: `terarachang/VaSE eval/reasoning_tasks/modified/transformers/cache_utils.py`, mode
`range_sink_sample_attn` (also the Random Attention engine's, `kvcompress/engine/cache_utils.py`).
At a round, per row, layer and KV head, over the candidates (valid slots outside the recency
window):
  1. range_j = max_d v_jd - min_d v_jd; the first 4 positions (attention sinks, `n_sink = 4`)
     get +inf (the original pins the first 4 cache slots, which hold positions 0-3 since
     they are never evicted);
  2. the large set = the n_large eligible slots of largest range (ties -> older slot);
  3. attention a_j = the SnapKV "paper" score (`snapkv.snapkv_scores`: the interval's queries,
     per-head softmax over the candidates, mean, avg-pool 5, group mean), 0 on the large set;
  4. K - n_large further slots are drawn without replacement with probability proportional to
     a_j (`torch.multinomial(..., replacement=False)` in the original);
  5. keep = large set + drawn slots.

Here step 4 is Gumbel-top-k: key_j = log a_j + G_j, G_j = -log(-log u_j), and the K - n_large
largest keys are kept, which is the same distribution as successive proportional draws. The
uniforms come from `kernels.hash_prng.eviction_draws(seed, row seed, layer, KV head, the row's
generated count at the round, slot)` (u = `hash_prng.open_uniform(draw)`, exactly inside (0, 1)),
so a request's keep-sets depend
on its own seed only. `vase_scores` returns one priority per slot whose top-K is that keep set:
+inf on the large set, key_j elsewhere (log a_j floored at the smallest normal float32, so an
underflowed attention ranks last but stays finite), and the shared `EvictionPolicy.keep_mask`
selects the top K (K = K_sel - pinned, `randkv_jax.rule`).

n_large = budget // 4 by default: VaSE's own release scripts use T/4 at every budget (T 1024 ->
256, 2048 -> 512, 4096 -> 1024) and the paper's grid does the same (`run_cell.sh`: `NL=$((K/4))`
with `--token_budget $K`); a fixed 256 at larger T is not VaSE's setting (the paper's App. F
warns it degrades VaSE). `n_large=` overrides it; it never exceeds the row's K.

Default protect "none": the original protects no prompt; it pins the 4 sinks itself, inside the
budget (step 1). With protect "prompt" (the engine's `range_sink_sample_attn_pp`) the prompt is
pinned inside the budget as for every policy here, and both the large set and the draws come
from the other entries.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.hash_prng import eviction_draws, open_uniform
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.policies.snapkv import SNAPKV_PRESETS, snapkv_scores
from randkv_jax.rule import select_top

N_SINK = 4


def gumbel(draws: Int[Array, "..."]) -> Float[Array, "..."]:
    """Standard Gumbel noise from 24-bit hash draws: -log(-log(u)), u = `open_uniform(draw)` (finite)."""
    return -jnp.log(-jnp.log(open_uniform(draws)))


def vase_scores(
    queries: Float[Array, "b h w d"],
    keys: Float[Array, "b k s d"],
    values: Float[Array, "b k s d"],
    positions: Int[Array, "b k s"],
    candidates: Bool[Array, "b k s"],
    eligible: Bool[Array, "b k s"],
    n_large: Int[Array, " b"],
    noise: Float[Array, "b k s"],
) -> Float[Array, "b k s"]:
    """One layer's VaSE priority: +inf on the large set, log(attention) + Gumbel noise elsewhere.

    queries: the last r window queries; candidates: the slots the attention softmax runs over;
    eligible: the slots that may be selected (candidates minus protected prompt entries);
    n_large [b]: size of the large set per row; noise [b, k, s]: standard Gumbel draws.
    Keeping the top K eligible slots by this priority is VaSE's keep rule (n_large <= K).
    """
    v = values.astype(jnp.float32)
    value_range = jnp.where(positions < N_SINK, jnp.inf, v.max(axis=-1) - v.min(axis=-1))
    large = select_top(value_range, eligible, n_large[:, None])
    paper = SNAPKV_PRESETS["paper"]
    attention = snapkv_scores(queries, keys, candidates, kernel=paper.kernel, pool=paper.pool, group=paper.group)
    key = jnp.log(jnp.maximum(attention, jnp.finfo(jnp.float32).tiny)) + noise
    return jnp.where(large, jnp.inf, key)


@dataclasses.dataclass(frozen=True)
class VaSE(EvictionPolicy):
    name: ClassVar[str] = "vase"
    protect: str = "none"
    n_large: int | None = None
    """Entries kept for their value range; None: budget // 4 (VaSE's setting at every budget)."""
    seed: int = 0
    """Seed of the sampling draws (with each row's seed)."""

    def _validate(self) -> None:
        if self.n_large is not None and (not isinstance(self.n_large, int) or self.n_large < 0):
            raise ValueError(f"VaSE: n_large must be a non-negative integer or None, got {self.n_large!r}")

    @property
    def needs(self) -> ScoringNeeds:
        return ScoringNeeds(query_window=self.interval)

    def large_per_row(self, prompt_lens: Int[Array, " b"]) -> Int[Array, " b"]:
        """Size of the large set per row (at most the entries a round selects)."""
        n_large = self.budget // 4 if self.n_large is None else self.n_large
        return jnp.minimum(n_large, self.rule.n_select(prompt_lens))

    def scores(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None
    ) -> Float[Array, "l b k s"]:
        if observations is None or observations.queries is None:
            raise ValueError("VaSE needs observations with queries (its `needs`)")
        l, b, k, s = buffer.positions.shape
        per_row = lambda x: x[None, :, None, None]  # noqa: E731
        draws = eviction_draws(
            self.seed, per_row(row_seeds), jnp.arange(l)[:, None, None, None], buffer.head_ids[None, None, :, None],
            per_row(buffer.generated), jnp.arange(s)[None, None, None, :],
        )
        masks = self.round_masks(buffer)
        n_large = self.large_per_row(buffer.prompt_lens)
        return jax.lax.map(  # one layer at a time
            lambda x: vase_scores(*x[:6], n_large, x[6]),
            (observations.queries, buffer.keys, buffer.values, buffer.positions, masks.candidates, masks.eligible,
             gumbel(jnp.broadcast_to(draws, (l, b, k, s)))),
        )
