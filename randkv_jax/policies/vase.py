"""VaSE (arXiv 2606.03928): keep the entries with the largest value range, then sample the rest in
proportion to their attention.

Source: `terarachang/VaSE eval/reasoning_tasks/modified/transformers/cache_utils.py`, mode
`range_sink_sample_attn` (also the Random Attention engine's, `kvcompress/engine/cache_utils.py`).
At a round, per row, layer and KV head, over the candidates (valid slots outside the r-token
recency window):
  1. range_j = max_d v_jd - min_d v_jd; the first 4 positions (attention sinks, `n_sink = 4`)
     get +inf (the original pins the first 4 cache slots, which hold positions 0-3 since
     they are never evicted);
  2. the large set = the n_large eligible slots of largest range (ties -> older slot);
  3. attention a_j = the SnapKV "paper" score (`snapkv.snapkv_scores`: the last r queries,
     per-head softmax over the candidates, mean, avg-pool 5, group mean), 0 on the large set;
  4. K - n_large further slots are drawn without replacement with probability proportional to
     a_j (`torch.multinomial(..., replacement=False)` in the original);
  5. keep = large set + drawn slots.

Here step 4 is Gumbel-top-k: key_j = log a_j + G_j, G_j = -log(-log u_j), and the K - n_large
largest keys are kept, which is the same distribution as successive proportional draws. The
uniforms come from `kernels.hash_prng.eviction_draws(seed, row seed, layer, KV head, round,
slot)` (u = (draw + 1/2) / 2^24), so a request's keep-sets depend on its own seed only.
`vase_scores` returns one priority per slot whose top-K is that keep set: +inf on the large set,
key_j elsewhere (log a_j floored at the smallest normal float32, so an underflowed attention
ranks last but stays finite), and the shared `EvictionPolicy.keep_mask` selects the top K.

Presets: "paper" n_large = (K + r) / 4, the paper's grid (`scripts/run_cell.sh`:
`NL=$((K/4))` with `--token_budget $K`, i.e. a quarter of the engine's token budget K + r;
VaSE's own scripts use 256 at token budget 1024, the same value); "original" n_large = 256
(`myscripts/*/eval_range_sink_sample_attn.sh`). n_large never exceeds the row's K.

Default protect "none": the original protects no prompt; it pins the 4 sinks itself, inside the
budget (step 1), which `protect="sinks:4"` would instead keep outside K (and step 1 would then
spend 4 more large slots). With protect "prompt" (the engine's `range_sink_sample_attn_pp`),
the prompt is kept on top of K, as for every policy here, and both the large set and the draws
come from generated entries.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.kernels.hash_prng import DRAW_BITS, eviction_draws
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.policies.base import EvictionPolicy, select_top
from randkv_jax.policies.snapkv import SNAPKV_PRESETS, attention_candidates, snapkv_scores

N_SINK = 4
VASE_PRESETS = {"paper": None, "original": 256}
"""n_large per preset; None: (K + r) // 4 per row."""


def gumbel(draws: Int[Array, "..."]) -> Float[Array, "..."]:
    """Standard Gumbel noise from 24-bit hash draws: -log(-log(u)), u = (draw + 1/2) / 2^24."""
    u = (draws.astype(jnp.float32) + 0.5) / 2.0**DRAW_BITS
    return -jnp.log(-jnp.log(u))


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
    large = select_top(value_range[None], eligible[None], n_large)[0]
    paper = SNAPKV_PRESETS["paper"]
    attention = snapkv_scores(queries, keys, candidates, kernel=paper.kernel, pool=paper.pool, group=paper.group)
    key = jnp.log(jnp.maximum(attention, jnp.finfo(jnp.float32).tiny)) + noise
    return jnp.where(large, jnp.inf, key)


@dataclasses.dataclass(frozen=True)
class VaSE(EvictionPolicy):
    name: ClassVar[str] = "vase"
    protect: str = "none"
    preset: str = "paper"
    """A key of `VASE_PRESETS`: "paper" (n_large = (K + r) / 4) or "original" (n_large = 256)."""
    seed: int = 0
    """Seed of the sampling draws (with each row's seed)."""

    def __post_init__(self):
        super().__post_init__()
        if self.preset not in VASE_PRESETS:
            raise ValueError(f"VaSE preset must be one of {sorted(VASE_PRESETS)}, got {self.preset!r}")

    @property
    def needs(self) -> ScoringNeeds:
        return ScoringNeeds(query_window=self.buffer)

    def n_large(self, prompt_lens: Int[Array, " b"]) -> Int[Array, " b"]:
        """Size of the large set per row (at most the row's K)."""
        kept = self.kept_per_row(prompt_lens)
        fixed = VASE_PRESETS[self.preset]
        return jnp.minimum((kept + self.buffer) // 4 if fixed is None else fixed, kept)

    def scores(
        self,
        buffer: KVBuffer,
        n_generated: Int[Array, ""],
        row_seeds: Int[Array, " b"],
        observations: Observations | None = None,
    ) -> Float[Array, "l b k s"]:
        if observations is None or observations.queries is None:
            raise ValueError("VaSE needs observations with queries (its `needs`)")
        l, b, k, s = buffer.positions.shape
        draws = eviction_draws(
            self.seed, row_seeds[None, :, None, None], jnp.arange(l)[:, None, None, None],
            jnp.arange(k)[None, None, :, None], n_generated // self.buffer, jnp.arange(s)[None, None, None, :],
        )
        candidates = attention_candidates(buffer, n_generated, self.buffer)
        eligible = buffer.valid & ~self.protected(buffer, n_generated)
        n_large = self.n_large(buffer.prompt_lens)
        return jax.lax.map(  # one layer at a time
            lambda x: vase_scores(*x[:6], n_large, x[6]),
            (observations.queries, buffer.keys, buffer.values, buffer.positions, candidates, eligible,
             gumbel(jnp.broadcast_to(draws, (l, b, k, s)))),
        )
