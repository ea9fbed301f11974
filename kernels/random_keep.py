"""Random Attention's eviction round as one Pallas kernel: the keep mask of every (row, layer, KV head).

    keep = random_keep_mask(positions, prompt_lens, generated, n_select, row_seeds, seed,
                            rule=EvictionRule(...), platform="tpu", interpret=False)

For one eviction round and each (batch row b, layer l, KV head h) the kernel keeps
  - every protected slot: pinned prompt entries and the window, as `rule.masks` says (the one
    definition the policies and `due` use too, called inside the kernel body);
  - the `n_select[b]` eligible slots with the highest draw
    `eviction_draws(seed, row_seeds[b], l, first_head + h or 0, generated[b], slot // slots_per_draw)`, ties
    going to the lower slot (all eligible slots when there are no more than `n_select[b]`: pass
    n_select >= slots for a row that is not due);
  - nothing else (empty slots, `pos == -1`, are never kept).
This is exactly `EvictionPolicy.keep_mask`'s selection (`rule.select_top`: stable argsort of
-score) with Random Attention's scores, bit for bit; `random_keep_mask_reference` is the same
function in plain jnp (argsort, `lax.top_k` or the kernel's own bisection, all three equal).
The round's identity in the draw is the row's generated count at the round (a positive
multiple of the interval, so distinct per round and per request).

How the kernel works (no sort, top_k, cumsum, `jax.random` or hardware PRNG inside):
  1. the draws are recomputed in the kernel from iota counters with `hash_prng.eviction_draws`
     (uint32 multiply / xor / shift only), the scalars (seed, first head; per row: prompt length, generated
     count, n_select, row seed) read from SMEM on TPU;
  2. a 24-step bisection over the 24-bit draw finds T, the K-th largest eligible draw (the largest
     T with #{eligible, draw >= T} >= K); every eligible slot with draw > T is kept;
  3. among eligible slots with draw == T, a second bisection over the slot index finds the bound U
     with #{tie, slot < U} = K - #{draw > T}: the ties go to the lowest slots.
Each bisection step is one compare and one sum reduction over the slot axis (f32 counts, exact
below 2^24), so a round costs 24 + bit_length(S) reductions whatever K is.

Backends (`platform`, chosen by the caller; `RandomAttention` derives it from the decode
program's platform):
  - "tpu" (Mosaic TPU): grid (batch, layer), one [KV heads, S] block per program (full head and
    slot dims, so any head count and any S), scalars in SMEM (`pl.BlockSpec(memory_space=SMEM)`),
    both grid axes "parallel". Cross-lowered on CPU for Qwen3-4B/32B and Phi-4-reasoning shapes
    (tests/test_random_keep.py); Mosaic's own compilation (libtpu) has not been run here.
  - "triton" (Pallas Triton, GPU): grid (batch, layer, KV head), one [1, S_pad] block per program
    with S_pad = next power of two >= S (Triton needs power-of-two arrays); the overhang is
    masked on load (read as empty) and on store. Heads are a grid axis, so 10 KV heads (Phi-4)
    need no padding. Cross-lowered on CPU with `plt.CompilerParams`.
  - Mosaic GPU (the default for a "cuda" lowering without Triton compiler params) is NOT covered:
    on this JAX (0.10.2) its lowering rejects these kernels (scalar loads "not divisible by
    warpgroup size", iota layout inference), see docs/kernels.md.
`interpret=True` runs either layout in Pallas' interpret mode (on CPU); both give the same
masks as the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Bool, Int

from randkv_jax.kernels.hash_prng import DRAW_BITS, eviction_draws
from randkv_jax.rule import EvictionRule, select_top

PLATFORMS = ("tpu", "triton")
METHODS = ("argsort", "top_k", "bisect")
_ROW_FIELDS = 4  # per-row scalars: prompt length, generated count, n_select, row seed


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _as_int32(seed) -> Int[Array, ""]:
    """A Python or array seed as int32, wrapping like `eviction_draws`' uint32 cast."""
    if isinstance(seed, (int, np.integer)):
        return jnp.asarray(np.array(int(seed) % 2**32, np.uint32).view(np.int32))
    return jnp.asarray(seed).astype(jnp.int32)


def _draw_block(slot, slots_per_draw: int):
    """slot // slots_per_draw for slot >= 0 (a shift when it is a power of two)."""
    if slots_per_draw == 1:
        return slot
    if slots_per_draw & (slots_per_draw - 1) == 0:
        return slot >> (slots_per_draw.bit_length() - 1)
    return jax.lax.div(slot, jnp.int32(slots_per_draw))


def _count(mask):
    """Per-(..., head) count of a mask over the slot axis, as f32 (exact below 2^24)."""
    return jnp.sum(jnp.where(mask, 1.0, 0.0).astype(jnp.float32), axis=-1, keepdims=True)


def _bisect_keep(eligible, draws, slot, count, *, slot_bits: int):
    """The `count` highest draws among eligible slots, ties to the lower slot, by two bisections.

    eligible [..., S] bool; draws [..., S] int32 in [0, 2^24); slot [..., S] int32; count broadcasts
    against [..., 1]. Only compares, selects and sum reductions: portable to Mosaic and Triton.
    """
    count = jnp.asarray(count).astype(jnp.float32)
    ranked = jnp.where(eligible, draws, -1)

    def search(carry_init, bits, ok):
        # greedy from the top bit: keep each bit whose setting still satisfies `ok`
        def step(i, value):
            cand = value | jnp.left_shift(jnp.int32(1), bits - 1 - i)
            return jnp.where(ok(cand), cand, value)
        return jax.lax.fori_loop(0, bits, step, carry_init)

    zero = jnp.zeros(ranked.shape[:-1] + (1,), jnp.int32)
    # T: the largest threshold with at least `count` eligible draws >= T (0 when fewer are eligible)
    thr = search(zero, DRAW_BITS, lambda cand: _count(ranked >= cand) >= count)
    above = ranked > thr
    need = count - _count(above)
    # ties at T: the lowest `need` slots; U = the largest bound with #{tie, slot < U} <= need
    tie_slot = jnp.where(ranked == thr, slot, jnp.int32(2**31 - 1))
    bound = search(zero, slot_bits, lambda cand: _count(tie_slot < cand) <= need)
    return above | (tie_slot < bound)


def _tile_keep(pos, head, slot, seed, row, layer, *, rule, shared_across_heads, slots_per_draw, slot_bits):
    """Keep mask (int32 0/1) of one [heads, slots] tile of row `row` and layer `layer`."""
    prompt_len, generated, n_select, row_seed = row
    masks = rule.masks(pos, prompt_len, generated)
    draws = eviction_draws(
        seed, row_seed, layer, 0 if shared_across_heads else head, generated, _draw_block(slot, slots_per_draw)
    ).astype(jnp.int32)
    draws = jnp.broadcast_to(draws, pos.shape)
    keep = masks.protected | _bisect_keep(masks.eligible, draws, slot, n_select, slot_bits=slot_bits)
    return jnp.where(keep, 1, 0).astype(jnp.int32)


def _tpu_kernel(seed_ref, rows_ref, pos_ref, out_ref, **settings):
    b, l = pl.program_id(0), pl.program_id(1)
    pos = pos_ref[...]
    head = jax.lax.broadcasted_iota(jnp.int32, pos.shape, 0) + seed_ref[1]
    slot = jax.lax.broadcasted_iota(jnp.int32, pos.shape, 1)
    row = tuple(rows_ref[b * _ROW_FIELDS + i] for i in range(_ROW_FIELDS))
    out_ref[...] = _tile_keep(pos, head, slot, seed_ref[0], row, l, **settings)


def _triton_kernel(seed_ref, rows_ref, pos_ref, out_ref, *, num_slots, **settings):
    l, h = pl.program_id(1), pl.program_id(2)
    shape = pos_ref.shape  # [1, S_pad]
    slot = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    in_range = slot < num_slots
    pos = plt.load(pos_ref, mask=in_range, other=-1)
    row = tuple(rows_ref[i] for i in range(_ROW_FIELDS))
    head = jnp.full(shape, h + seed_ref[1], jnp.int32)
    plt.store(out_ref, _tile_keep(pos, head, slot, seed_ref[0], row, l, **settings), mask=in_range)


def _num_warps(s_pad: int) -> int:
    return 4 if s_pad <= 1024 else 8 if s_pad <= 8192 else 16


@functools.partial(
    jax.jit, static_argnames=("rule", "shared_across_heads", "slots_per_draw", "platform", "interpret", "num_warps"),
)
def _random_keep_call(
    positions, prompt_lens, generated, n_select, row_seeds, seed, first_head, *,
    rule, shared_across_heads, slots_per_draw, platform, interpret, num_warps,
):
    l, b, k, s = positions.shape
    per_row = (prompt_lens, generated, n_select, row_seeds)
    rows = jnp.stack([jnp.asarray(x).astype(jnp.int32) for x in per_row], axis=1).reshape(-1)  # [b * 4]
    seed = jnp.stack([seed, first_head])  # [global seed, global index of the first KV head]
    out_shape = jax.ShapeDtypeStruct((l, b, k, s), jnp.int32)
    settings = dict(rule=rule, shared_across_heads=shared_across_heads, slots_per_draw=slots_per_draw)
    if platform == "tpu":
        smem = pl.BlockSpec(memory_space=pltpu.SMEM)
        tile = pl.BlockSpec((None, None, k, s), lambda bi, li: (li, bi, 0, 0))
        return pl.pallas_call(
            functools.partial(_tpu_kernel, slot_bits=s.bit_length(), **settings),
            grid=(b, l),
            in_specs=[smem, smem, tile],
            out_specs=tile,
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            interpret=interpret,
            name="random_keep_tpu",
        )(seed, rows, positions)
    s_pad = _next_pow2(s)
    tile = pl.BlockSpec((None, None, 1, s_pad), lambda bi, li, hi: (li, bi, hi, 0))
    return pl.pallas_call(
        functools.partial(_triton_kernel, slot_bits=s_pad.bit_length(), num_slots=s, **settings),
        grid=(b, l, k),
        in_specs=[
            pl.BlockSpec((2,), lambda bi, li, hi: (0,)),
            pl.BlockSpec((_ROW_FIELDS,), lambda bi, li, hi: (bi,)),
            tile,
        ],
        out_specs=tile,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps or _num_warps(s_pad), num_stages=1),
        interpret=interpret,
        name="random_keep_triton",
    )(seed, rows, positions)


def random_keep_mask(
    positions: Int[Array, "l b k s"],
    prompt_lens: Int[Array, " b"],
    generated: Int[Array, " b"],
    n_select: Int[Array, " b"],
    row_seeds: Int[Array, " b"],
    seed,
    *,
    rule: EvictionRule,
    platform: str,
    interpret: bool,
    shared_across_heads: bool = False,
    slots_per_draw: int = 1,
    first_head=0,
    num_warps: int | None = None,
) -> Bool[Array, "l b k s"]:
    """One eviction round's keep mask from the Pallas kernel (see the module docstring).

    Args:
      positions: absolute position per slot, -1 = empty ([layers, batch, KV heads, slots]).
      prompt_lens, generated, n_select, row_seeds: per row: prompt length, generated count (the
        window's end and the round's identity in the draws), eligible entries to keep (pass
        n_select >= slots to keep everything valid), and the row's seed.
      seed: the policy's global seed (int or int32 scalar).
      rule: pins and window (`EvictionRule.masks`); its `n_select` is the caller's to apply.
      platform: "tpu" (Mosaic layout) or "triton" (GPU); interpret: run in interpret mode (CPU).
      shared_across_heads, slots_per_draw: Random Attention's controls.
      first_head: the global index of head 0 of `positions` (int or int32 scalar): a shard of a
        buffer split over KV heads draws with its heads' global numbers.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    _check_slots_per_draw(slots_per_draw)
    if positions.shape[-1] >= 2**24:
        raise ValueError("at most 2^24 - 1 slots (counts are exact f32 sums)")
    out = _random_keep_call(
        positions, prompt_lens, generated, n_select, row_seeds, _as_int32(seed), _as_int32(first_head), rule=rule,
        shared_across_heads=bool(shared_across_heads), slots_per_draw=slots_per_draw, platform=platform,
        interpret=bool(interpret), num_warps=num_warps,
    )
    return out != 0


def _check_slots_per_draw(slots_per_draw) -> None:
    if not isinstance(slots_per_draw, int) or slots_per_draw <= 0:
        raise ValueError(f"slots_per_draw must be a positive integer, got {slots_per_draw!r}")


def random_keep_mask_reference(
    positions: Int[Array, "l b k s"],
    prompt_lens: Int[Array, " b"],
    generated: Int[Array, " b"],
    n_select: Int[Array, " b"],
    row_seeds: Int[Array, " b"],
    seed,
    *,
    rule: EvictionRule,
    shared_across_heads: bool = False,
    slots_per_draw: int = 1,
    method: str = "argsort",
    max_select: int | None = None,
    first_head=0,
) -> Bool[Array, "l b k s"]:
    """`random_keep_mask` in plain jnp (XLA); the same mask bit for bit, by one of three methods.

    "argsort": `rule.select_top` on the draws (a stable argsort of -draw, as the policies use);
    "top_k":   `lax.top_k` over the draws (equal values come out lower index first) with a static
               k = `max_select` (an upper bound of `n_select`; default: the slot count);
    "bisect":  the kernel's own threshold bisection, run by XLA over the whole [l, b, k, s] array.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_slots_per_draw(slots_per_draw)
    return _reference_call(
        positions, prompt_lens, generated, n_select, row_seeds, _as_int32(seed), _as_int32(first_head), rule=rule,
        shared_across_heads=bool(shared_across_heads), slots_per_draw=slots_per_draw, method=method,
        max_select=max_select,
    )


@functools.partial(
    jax.jit, static_argnames=("rule", "shared_across_heads", "slots_per_draw", "method", "max_select")
)
def _reference_call(
    positions, prompt_lens, generated, n_select, row_seeds, seed, first_head, *,
    rule, shared_across_heads, slots_per_draw, method, max_select,
):
    l, b, k, s = positions.shape
    row = lambda x: jnp.asarray(x, jnp.int32)[None, :, None, None]  # noqa: E731
    masks = rule.masks(positions, row(prompt_lens), row(generated))
    count = row(n_select)
    layer = jnp.arange(l, dtype=jnp.int32)[:, None, None, None]
    head = 0 if shared_across_heads else first_head + jnp.arange(k, dtype=jnp.int32)[None, None, :, None]
    slot = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
    draws = eviction_draws(
        seed, row(row_seeds), layer, head, row(generated), _draw_block(slot, slots_per_draw)
    ).astype(jnp.int32)
    draws = jnp.broadcast_to(draws, positions.shape)
    if method == "bisect":
        selected = _bisect_keep(masks.eligible, draws, jnp.broadcast_to(slot, positions.shape), count,
                                slot_bits=s.bit_length())
    elif method == "argsort":
        selected = select_top(draws.astype(jnp.float32), masks.eligible, count[..., 0])
    else:
        top = min(s, s if max_select is None else max_select)
        if top <= 0:
            return masks.protected
        ranked = jnp.where(masks.eligible, draws, -1)
        _, idx = jax.lax.top_k(ranked, top)  # [l, b, k, top], ties lower index first
        take = jnp.arange(top)[None, None, None, :] < count
        chosen = jnp.zeros(positions.shape, jnp.int32)
        chosen = jnp.put_along_axis(chosen, idx, take.astype(jnp.int32), axis=-1, inplace=False)
        selected = masks.eligible & (chosen > 0)
    return masks.protected | selected
