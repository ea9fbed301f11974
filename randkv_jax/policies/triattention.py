"""TriAttention (arXiv 2604.04921): rank keys by the attention calibrated mean queries would give them.

Source: WeianMao/triattention at c3744ee6 (`triattention/methods/triattention.py` "tri",
`triattention/methods/pruning_utils.py` "pu", `scripts/cli.py` "cli"). Statistics per (layer,
query head): q_mean_f = E[q_f], q_abs_mean_f = E|q_f| over pre-RoPE calibration queries, in
complex frequency pairs f < r/2 (`randkv_jax.calibration`).

Score of a candidate key of KV head j at absolute position p, for query head h of j's group, at a
round where t = the number of tokens in the sequence (the position the next token will take):

    k_f      = RoPE^-1(key at p), split into pairs the same way       (tri L637-638, pu L51-98)
    amp_f    = |q_mean_f| |k_f|,   phi_f = arg(q_mean_f * conj(k_f))   (pu L264-269)
    extra_f  = (q_abs_mean_f - |q_mean_f|) |k_f|                       (pu L273)
    S(k)     = mean_{delta in D} sum_f amp_f s_f^2 cos(omega_f (t - p + delta) + phi_f)
               + sum_f extra_f s_f^2                                   (pu L292-308)

with D = {1, 2, 4, ..., 2^16} (powers of two up to `offset_max` = 65536; pu L245-253, tri L43,
cli L311), the mean over D (cli L312), omega_f = RoPE inv_freq and s_f = the RoPE attention
scaling (1 for plain RoPE; pu L212-224). t is the compressor's `absolute_position` after the
decode step that triggered the round (tri L650-653, L880-892); here t = prompt_len + generated.
amp cos(omega Delta + phi) = Re(q_mean conj(k) exp(i omega Delta)), so the mean over D is
computed exactly as Re(q_mean conj(k) exp(i omega (t - p)) M) with M_f = mean_D exp(i omega_f
delta) evaluated once in float64 (the repo evaluates each offset's phase in float32).

Aggregation ("per_head", the paper's variant: cli L302, tri L368-450):
  1. z-normalise each (layer, query head)'s scores over the round's candidates: population std,
     clamped below at 1e-6 (tri L259-262; on in every runner, cli L307);
  2. add 1e-6 * U[0, 1) tie-break noise per (layer, query head, slot) (tri L264-271; the repo
     draws it from a torch generator seeded with `pruning_seed` = 0, cli L313; here from
     `kernels.hash_prng.eviction_draws(seed, row_seed, layer, query head, generated, slot)`);
  3. per KV head: max over its query group (h // g, tri L400, L420), then mean over layers (L426);
  4. keep the top K per KV head, the same slots in every layer (tri L431-434, L967-983).
Candidates are the round's eligible slots (valid, neither pinned nor in the window). The repo's
are all decode tokens (tri L205-224): its HF path has no recency window, while here the window
is kept by the shared rule and takes no part in the normalisation.
The prompt is pinned by default (`protect="prompt"`, tri L182-184, L442-448), inside the budget
as the repo counts it (`decode_budget = budget - prefix`; `randkv_jax.rule`). Because every
round keeps the same slots in all layers, a slot holds the same token in every layer, which the
mean over layers relies on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.calibration import CalibrationStats, load_stats
from randkv_jax.kernels.hash_prng import eviction_draws, open_uniform
from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.policies.scoring import reduce_group

NOISE_SCALE = 1e-6
STD_FLOOR = 1e-6


def offsets(offset_max: int) -> np.ndarray:
    """D = {1, 2, 4, ...} up to `offset_max` (the repo's `build_geometric_offsets`)."""
    return 2.0 ** np.arange(int(offset_max).bit_length())


def frequency_scores(
    keys: Float[Array, "b k s d"],
    positions: Int[Array, "b k s"],
    t: Int[Array, " b"],
    q_mean_real: Float[Array, "h f"],
    q_mean_imag: Float[Array, "h f"],
    q_abs_mean: Float[Array, "h f"],
    inv_freq: np.ndarray,
    scaling: float,
    offset_max: int = 65536,
) -> Float[Array, "b h s"]:
    """TriAttention's S(k) of one layer's post-RoPE keys for each query head (float32).

    `inv_freq` [f] (numpy, static), f = d / 2; query head h uses KV head h // (h_total / k).
    Scores at empty slots (position -1) are meaningless.
    """
    f = inv_freq.shape[0]
    omega = jnp.asarray(inv_freq, jnp.float32)
    # pre-RoPE key pairs: rotated pair = s * k_f * exp(i omega p), as `models.rope` applies it
    angle = positions.astype(jnp.float32)[..., None] * omega
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    post = keys.astype(jnp.float32)
    re, im = post[..., :f], post[..., f : 2 * f]
    k_re, k_im = (re * cos + im * sin) / scaling, (im * cos - re * sin) / scaling
    # W = s^2 exp(i omega (t - p)) M, with M = mean over D of exp(i omega delta)
    d64 = offsets(offset_max)[:, None] * np.asarray(inv_freq, np.float64)[None]
    m_re, m_im = (jnp.asarray(x.mean(axis=0), jnp.float32) for x in (np.cos(d64), np.sin(d64)))
    delta = (t[:, None, None] - positions).astype(jnp.float32)[..., None] * omega
    c, s = jnp.cos(delta), jnp.sin(delta)
    w_re, w_im = scaling**2 * (c * m_re - s * m_im), scaling**2 * (c * m_im + s * m_re)
    # A = conj(k) W; sum_f Re(q_mean A) per query head of the KV head's group
    a_re, a_im = k_re * w_re + k_im * w_im, k_re * w_im - k_im * w_re
    b, kv, n = keys.shape[0], keys.shape[1], keys.shape[2]
    group = lambda x: x.reshape(kv, -1, f)  # noqa: E731  [h, f] -> [k, g, f]
    main = jnp.einsum("kgf,bksf->bkgs", group(q_mean_real), a_re) - jnp.einsum(
        "kgf,bksf->bkgs", group(q_mean_imag), a_im)
    excess = q_abs_mean - jnp.sqrt(q_mean_real**2 + q_mean_imag**2)
    extra = scaling**2 * jnp.einsum("kgf,bksf->bkgs", group(excess), jnp.sqrt(k_re**2 + k_im**2))
    return (main + extra).reshape(b, -1, n)


def aggregate_per_head(
    scores: Float[Array, "l b h s"], candidates: Bool[Array, "l b k s"], noise: Float[Array, "l b h s"]
) -> Float[Array, "b k s"]:
    """z-normalise each (layer, head) over its candidates, add NOISE_SCALE * noise (in [0, 1)),
    max over each KV head's query group, mean over layers. Non-candidates count as 0."""
    l, b, h, s = scores.shape
    kv = candidates.shape[2]
    mask = jnp.repeat(candidates, h // kv, axis=2)
    count = jnp.maximum(mask.sum(axis=-1, keepdims=True), 1)
    mean = jnp.where(mask, scores, 0.0).sum(axis=-1, keepdims=True) / count
    var = jnp.where(mask, (scores - mean) ** 2, 0.0).sum(axis=-1, keepdims=True) / count
    z = (scores - mean) / jnp.maximum(jnp.sqrt(var), STD_FLOOR) + NOISE_SCALE * noise
    grouped = reduce_group(z.reshape(l * b, h, s), kv, "max").reshape(l, b, kv, s)
    return jnp.where(candidates, grouped, 0.0).mean(axis=0)


@dataclasses.dataclass(frozen=True)
class TriAttention(EvictionPolicy):
    """TriAttention with calibrated statistics `stats` (a directory written by `randkv calibrate`,
    or a checkpoint directory holding one in `triattention_stats/`, or loaded `CalibrationStats`)."""

    name: ClassVar[str] = "triattention"
    stats: Any = None
    seed: int = 0
    offset_max: int = 65536

    def _validate(self) -> None:
        if self.stats is None:
            raise ValueError("TriAttention needs calibration statistics: pass stats=DIR "
                             "(compute them with `randkv calibrate --model CHECKPOINT --text FILE`)")
        if isinstance(self.stats, (str, Path)):
            object.__setattr__(self, "stats", load_stats(self.stats))
        if not isinstance(self.stats, CalibrationStats):
            raise ValueError(f"stats must be a directory or CalibrationStats, got {type(self.stats).__name__}")
        if not isinstance(self.offset_max, int) or self.offset_max < 1:
            raise ValueError(f"offset_max must be a positive integer, got {self.offset_max!r}")

    def check_model(self, config) -> None:
        self.stats.check_model(config)

    def _check_shapes(self, buffer: KVBuffer) -> None:
        l, _, kv, _, d = buffer.keys.shape
        sl, sh, sf = self.stats.shape
        if (sl, 2 * sf) != (l, d) or sh % kv:
            raise ValueError(
                f"TriAttention statistics {self.stats.path} ({sl} layers, {sh} query heads, head dim {2 * sf}) "
                f"do not fit this model ({l} layers, {kv} KV heads, head dim {d}): calibrate for this model"
            )

    def scores(self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations=None) -> Float[Array, "l b k s"]:
        self._check_shapes(buffer)
        st = self.stats
        t = buffer.prompt_lens + buffer.generated

        def layer_scores(args):
            keys, positions, q_re, q_im, q_abs = args
            return frequency_scores(keys, positions, t, q_re, q_im, q_abs, st.inv_freq, st.attention_scaling,
                                    self.offset_max)

        # the query heads of the KV heads held (all of them, or one shard's under tensor parallelism)
        group = st.shape[1] // st.meta["num_kv_heads"]
        query_heads = (buffer.head_ids[:, None] * group + jnp.arange(group)).reshape(-1)
        per_head = lambda x: jnp.take(jnp.asarray(x), query_heads, axis=1)  # noqa: E731
        raw = jax.lax.map(layer_scores, (buffer.keys, buffer.positions, per_head(st.q_mean_real),
                                         per_head(st.q_mean_imag), per_head(st.q_abs_mean)))
        l, b, h, s = raw.shape
        per_row = lambda x: x[None, :, None, None]  # noqa: E731
        draws = eviction_draws(
            self.seed, per_row(row_seeds), jnp.arange(l)[:, None, None, None], query_heads[None, None, :, None],
            per_row(buffer.generated), jnp.arange(s)[None, None, None, :],
        )
        noise = open_uniform(draws)
        kept = aggregate_per_head(raw, self.round_masks(buffer).eligible, noise)
        return jnp.broadcast_to(kept[None], buffer.positions.shape)
