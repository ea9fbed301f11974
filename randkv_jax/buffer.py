"""KVBuffer: the fixed-shape, per-head KV cache carried through the decode loop.

Layout (l layers, b rows, k KV heads, s slots, d head dim):
- `keys`, `values` [l, b, k, s, d]: stored after RoPE, so evicting never re-rotates anything;
- `positions` [l, b, k, s] int32: the absolute sequence position of each slot, -1 when empty.
  Layers and heads hold different positions once eviction has run;
- `prompt_lens` [b]: the prompt length of each row (its positions 0 .. P-1 are the prompt);
- `fill` [b]: slots in use. Every layer and head of a row holds entries in slots [0, fill) only,
  in chronological order (prefill writes the prompt at slots [0, P); each generated token is
  appended at slot `fill`; compaction keeps order). All heads of a row hold the same number of
  entries, so one `fill` per row serves them all;
- `generated` [b]: generated tokens written to the row so far. The next token's RoPE position is
  its true position in the sequence, `prompt_lens + generated`, never its slot; eviction rounds
  and their random draws follow this per-row count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.models.bits import moved_as_bits
from randkv_jax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVBuffer:
    keys: Float[Array, "l b k s d"]
    """Post-RoPE keys."""
    values: Float[Array, "l b k s d"]
    """Values."""
    positions: Int[Array, "l b k s"]
    """Absolute position held by each slot; -1 = empty."""
    prompt_lens: Int[Array, " b"]
    """Prompt length per row."""
    fill: Int[Array, " b"]
    """Slots in use per row (entries live in [0, fill))."""
    generated: Int[Array, " b"]
    """Generated tokens written per row (the next one goes to position prompt_lens + generated)."""
    heads: Int[Array, " k"] | None = None
    """Global index of each KV head held (None: 0 .. k-1, an unsplit buffer)."""

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, capacity: int, dtype: Any) -> KVBuffer:
        shape = (config.num_layers, batch, config.num_kv_heads, capacity)
        return cls(
            keys=jnp.zeros((*shape, config.head_dim), dtype),
            values=jnp.zeros((*shape, config.head_dim), dtype),
            positions=jnp.full(shape, -1, jnp.int32),
            prompt_lens=jnp.zeros((batch,), jnp.int32),
            fill=jnp.zeros((batch,), jnp.int32),
            generated=jnp.zeros((batch,), jnp.int32),
            heads=jnp.arange(config.num_kv_heads, dtype=jnp.int32),
        )

    @property
    def head_ids(self) -> Int[Array, " k"]:
        """`heads`, or 0 .. k-1 when it is None."""
        if self.heads is None:
            return jnp.arange(self.positions.shape[2], dtype=jnp.int32)
        return self.heads

    @property
    def capacity(self) -> int:
        return self.positions.shape[-1]

    @property
    def valid(self) -> Bool[Array, "l b k s"]:
        return self.positions >= 0

    def slots_held(self) -> Int[Array, "l b k"]:
        """Valid entries per layer, row and head."""
        return jnp.sum(self.valid, axis=-1, dtype=jnp.int32)

    def bytes_per_slot(self) -> int:
        """Bytes of one slot across all layers and KV heads (keys and values)."""
        l, _, k, _, d = self.keys.shape
        return 2 * l * k * d * self.keys.dtype.itemsize


def compact(buffer: KVBuffer, keep: Bool[Array, "l b k s"], block: int = 128
            ) -> tuple[KVBuffer, Int[Array, "l b k s"]]:
    """Keep the `keep` slots of every layer/row/head, moved to the front in their old order.

    Every (layer, head) of a row must keep the same number of slots; that number becomes the
    row's `fill`. Freed slots become empty (-1; what their keys and values hold is unspecified,
    attention never reads them). Returns the buffer and the slot permutation applied (new slot j
    holds old slot `order[..., j]`), so per-slot state can follow it. Keys and values move in
    place, `block` slots at a time, from the first slot that changes (`_move_to_front`).
    """
    keep = keep & buffer.valid
    order, kept = _stable_partition(keep)
    in_use = jnp.arange(buffer.capacity) < kept[..., None]
    positions = jnp.where(in_use, jnp.take_along_axis(buffer.positions, order, axis=-1), -1)
    move = lambda x: moved_as_bits(lambda a: _move_to_front(a, order, kept, block), x)  # noqa: E731
    return dataclasses.replace(
        buffer,
        keys=move(buffer.keys),
        values=move(buffer.values),
        positions=positions,
        fill=kept[0, :, 0],
    ), order


def _move_to_front(x: Float[Array, "l b k s d"], order: Int[Array, "l b k s"], kept: Int[Array, "l b k"], block: int
                   ) -> Float[Array, "l b k s d"]:
    """`x` with slot j holding old slot `order[..., j]` for every j < kept (slots past `kept`
    keep what they held), written in place `block` slots at a time.

    Kept slots only move forward (`order[..., j] >= j` for j < kept), so going up the slots a
    block reads only slots that no earlier block wrote: no copy of the buffer is needed, and only
    the slots from the first that changes up to the largest `kept` are read and written (a
    round's prompt, at the front, never moves). A whole-array gather instead wrote a new buffer,
    then copied it back into the loop's (2 CPU cores, [30, 8, 3, 640, 64] float32: measured in
    docs/benchmarks.md)."""
    s = x.shape[-2]
    block = min(block, s)
    slots = jnp.arange(s, dtype=jnp.int32)
    changes = (order != slots) & (slots < kept[..., None])
    first = jnp.min(jnp.where(changes, slots, s))
    last = jnp.max(kept)

    def move_block(carry):
        x, lo = carry  # slots below lo hold their final entries
        start = jnp.minimum(lo, s - block)  # the last block ends at s (it may overlap written slots)
        at = start + slots[:block]
        moving = (at >= lo) & (at < kept[..., None])
        source = jnp.where(moving, jax.lax.dynamic_slice_in_dim(order, start, block, axis=-1), at)
        moved = jnp.take_along_axis(x, source[..., None], axis=-2)
        return jax.lax.dynamic_update_slice_in_dim(x, moved, start, axis=-2), start + block

    x, _ = jax.lax.while_loop(lambda carry: carry[1] < last, move_block, (x, first))
    return x


def _stable_partition(keep: Bool[Array, "... s"]) -> tuple[Int[Array, "... s"], Int[Array, "..."]]:
    """The permutation putting the `keep` slots first and the others after, each in their old
    order (`jnp.argsort(~keep, stable=True)`), and the kept count, by prefix sums and one scatter:
    no sort (on 2 CPU cores, [30, 8, 3, 640]: 4 ms against 31 ms for the argsort)."""
    kept = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    dest = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1,
                     kept[..., None] + jnp.cumsum(~keep, axis=-1, dtype=jnp.int32) - 1)  # where each slot goes
    slots = jnp.broadcast_to(jnp.arange(keep.shape[-1], dtype=jnp.int32), keep.shape)
    return jnp.put_along_axis(jnp.zeros_like(slots), dest, slots, axis=-1, inplace=False), kept


def insert_row(buffer: KVBuffer, slot: Int[Array, ""], prompt: KVBuffer, row: Int[Array, ""]) -> KVBuffer:
    """`buffer` with row `slot` replaced by row `row` of a prefilled `prompt` buffer.

    `prompt` holds t <= capacity slots (a prefill bucket). The row's positions become the
    prompt's for slots [0, t) and empty beyond, so nothing the slot held before is visible
    (stale keys and values past t stay, masked: attention never reads an empty slot, even a NaN
    one). Its prompt length, fill and generated count are reset. No other row is touched.
    """
    t = prompt.capacity
    if t > buffer.capacity:
        raise ValueError(f"a prefill of {t} slots does not fit a buffer of {buffer.capacity}")
    take = lambda x, axis=1: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=axis)  # noqa: E731
    put = lambda dest, x: moved_as_bits(  # noqa: E731
        lambda d, u: jax.lax.dynamic_update_slice(d, u, (0, slot) + (0,) * (d.ndim - 2)), dest, x)
    positions = jnp.full((*buffer.positions.shape[:1], 1, *buffer.positions.shape[2:]), -1, jnp.int32)
    positions = jax.lax.dynamic_update_slice(positions, take(prompt.positions), (0, 0, 0, 0))
    length = take(prompt.prompt_lens, 0)
    per_row = lambda dest, x: jax.lax.dynamic_update_slice(dest, x.astype(dest.dtype), (slot,))  # noqa: E731
    return dataclasses.replace(
        buffer,
        keys=put(buffer.keys, take(prompt.keys)),
        values=put(buffer.values, take(prompt.values)),
        positions=put(buffer.positions, positions),
        prompt_lens=per_row(buffer.prompt_lens, length),
        fill=per_row(buffer.fill, length),
        generated=per_row(buffer.generated, jnp.zeros((1,), jnp.int32)),
    )
