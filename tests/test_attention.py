"""`buffer_attention` against a dense NumPy reference: holes, per-head positions, per-row fills,
tails, causal T > 1, empty rows, NaN past `n_filled`, and one compile for every `n_filled`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from randkv_jax.attention import buffer_attention
from randkv_jax.models.bits import to_bits

# one compile per shape; eager dispatch of the while_loop op by op is much slower
attend = jax.jit(buffer_attention, static_argnames=("block_size", "bits_of"))


def reference(q, keys, values, slot_positions, query_positions, n_filled):
    """Dense softmax over visible slots in float64, GQA by an explicit repeat of the kv heads."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    keys = np.asarray(jnp.asarray(keys, jnp.float32), np.float64)[:, :, :n_filled]
    values = np.asarray(jnp.asarray(values, jnp.float32), np.float64)[:, :, :n_filled]
    pos = np.asarray(slot_positions)[:, :, :n_filled]
    qpos = np.asarray(query_positions)
    b, t, h, d = q.shape
    groups = h // keys.shape[1]
    keys, values, pos = (np.repeat(x, groups, axis=1) for x in (keys, values, pos))  # [b, h, s, ...]
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for hi in range(h):
            for ti in range(t):
                vis = (pos[bi, hi] >= 0) & (pos[bi, hi] <= qpos[bi, ti])
                if not vis.any():
                    continue
                scores = keys[bi, hi, vis] @ q[bi, ti, hi] / np.sqrt(d)
                w = np.exp(scores - scores.max())
                out[bi, ti, hi] = (w / w.sum()) @ values[bi, hi, vis]
    return out


def make_buffer(rng, b, t, h, kv, s, d, fills, *, hole_frac=0.2, dtype=jnp.float32):
    """Random buffer: row r has `fills[r]` leading slots, each head holding its own random distinct
    positions (with -1 holes); queries sit at positions around the held ones (causal for t > 1)."""
    pos = np.full((b, kv, s), -1, np.int32)
    max_pos = 4 * s + 8
    for bi, fill in enumerate(fills):
        for ki in range(kv):
            held = np.sort(rng.choice(max_pos, size=fill, replace=False)).astype(np.int32)
            held[rng.random(fill) < hole_frac] = -1
            pos[bi, ki, :fill] = held
    top = pos.max(axis=(1, 2))  # [b]
    # the last query sees everything; earlier ones see progressively less (causal)
    qpos = (np.maximum(top, 0)[:, None] - (t - 1 - np.arange(t))[None, :] * (max_pos // (2 * t + 1))).astype(np.int32)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    keys = rng.standard_normal((b, kv, s, d)).astype(np.float32)
    values = rng.standard_normal((b, kv, s, d)).astype(np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(keys, dtype),
        jnp.asarray(values, dtype),
        jnp.asarray(pos),
        jnp.asarray(qpos),
    )


TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])

# (b, t, h, kv, s, d, block). Compiling is most of this file's time, so tests share these shapes
# (runtime values such as n_filled and the fills never recompile).
WIDE = (3, 1, 8, 2, 100, 16, 16)  # GQA, s = 6 * 16 + 4: a clamped tail block
CAUSAL = (2, 4, 4, 4, 64, 8, 16)  # MHA, t = 4 causal queries, s a multiple of the block
SMALL = (2, 3, 6, 3, 40, 32, 256)  # s < block_size: one block of s
MQA = (1, 1, 4, 1, 300, 8, 64)


@DTYPES
@pytest.mark.parametrize(
    "shape,fills",
    [
        (WIDE, (37, 100, 0)),  # per-row fills, n_filled not a multiple of the block, an empty row
        (CAUSAL, (64, 50)),
        (SMALL, (23, 9)),
        (MQA, (1,)),  # a single filled slot
    ],
    ids=["wide", "causal", "small", "mqa"],
)
def test_matches_reference(dtype, shape, fills):
    b, t, h, kv, s, d, block = shape
    rng = np.random.default_rng(sum(fills) + 7 * s)
    q, keys, values, pos, qpos = make_buffer(rng, b, t, h, kv, s, d, fills, dtype=dtype)
    n = max(fills)
    out = attend(q, keys, values, pos, qpos, jnp.int32(n), block_size=block)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = reference(q, keys, values, pos, qpos, n)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **TOL[dtype])


def test_query_with_no_visible_slot_is_zero():
    b, t, h, kv, s, d, block = CAUSAL
    q, keys, values, pos, qpos = make_buffer(np.random.default_rng(1), b, t, h, kv, s, d, (40, 40), hole_frac=0.0)
    pos = pos.at[1].set(-1)  # row 1: every slot empty
    qpos = qpos.at[0, 0].set(-5)  # row 0, query 0: before every held position
    out = np.asarray(attend(q, keys, values, pos, qpos, jnp.int32(40), block_size=block))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(out[0, 0], 0.0)
    assert np.abs(out[0, 1:]).sum() > 0
    np.testing.assert_allclose(out, reference(q, keys, values, pos, qpos, 40), atol=1e-5, rtol=1e-5)
    # n_filled == 0: nothing is read at all
    np.testing.assert_array_equal(np.asarray(attend(q, keys, values, pos, qpos, jnp.int32(0), block_size=block)), 0.0)


@DTYPES
@pytest.mark.parametrize("shape,n", [(WIDE, 37), (WIDE, 48), (WIDE, 99), (SMALL, 5)], ids=str)
def test_slots_past_n_filled_are_not_read(dtype, shape, n):
    """NaN keys/values and *visible* positions past n_filled: only n_filled can be keeping them out
    (n = 99 of 100 puts the NaN inside the clamped tail block). Holes inside the prefix hold
    NaN / inf too (an empty slot's contents are never used)."""
    b, t, h, kv, s, d, block = shape
    fills = (n, n - 3, n - 1)[:b]
    q, keys, values, pos, qpos = make_buffer(np.random.default_rng(n), b, t, h, kv, s, d, fills, dtype=dtype)
    want = reference(q, keys, values, pos, qpos, n)
    beyond = jnp.arange(s) >= n
    keys = jnp.where(beyond[None, None, :, None], jnp.nan, keys)
    values = jnp.where(beyond[None, None, :, None], jnp.nan, values)
    pos = jnp.where(beyond[None, None, :], 0, pos)  # would be visible to every query
    holes = (pos < 0)[..., None]
    keys, values = jnp.where(holes, jnp.nan, keys), jnp.where(holes, jnp.inf, values)
    out = np.asarray(attend(q, keys, values, pos, qpos, jnp.int32(n), block_size=block), np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, **TOL[dtype])


def test_gqa_head_mapping_is_repeat_kv():
    """Query head h reads kv head h // groups: each kv head's values are a constant = its index."""
    b, t, h, kv, s, d, block = WIDE
    q = jnp.ones((b, t, h, d))
    keys = jnp.zeros((b, kv, s, d))
    values = jnp.broadcast_to(jnp.arange(kv, dtype=jnp.float32)[None, :, None, None], (b, kv, s, d))
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, kv, s))
    out = attend(q, keys, values, pos, jnp.full((b, t), s, jnp.int32), jnp.int32(s), block_size=block)
    np.testing.assert_allclose(np.asarray(out[:, 0, :, 0]), np.broadcast_to(np.arange(h) // (h // kv), (b, h)))


def test_jit_traces_once_for_every_n_filled():
    traces = []

    @jax.jit
    def attend_counted(q, keys, values, pos, qpos, n):
        traces.append(1)
        return buffer_attention(q, keys, values, pos, qpos, n, block_size=16)

    rng = np.random.default_rng(3)
    s = 100
    q, keys, values, pos, qpos = make_buffer(rng, 2, 1, 4, 2, s, 8, (s, s))
    for n in (0, 1, 16, 37, 64, 99, 100):
        out = attend_counted(q, keys, values, pos, qpos, jnp.int32(n))
        np.testing.assert_allclose(np.asarray(out), reference(q, keys, values, pos, qpos, n), atol=1e-5, rtol=1e-5)
    assert len(traces) == 1
    # the loop's trip count really is dynamic (a while_loop), not unrolled to the capacity
    jaxpr = jax.make_jaxpr(lambda n: buffer_attention(q, keys, values, pos, qpos, n, block_size=16))(jnp.int32(5))
    assert "while" in str(jaxpr)


def test_rejects_bad_shapes():
    q = jnp.zeros((1, 1, 6, 8))
    keys = jnp.zeros((1, 4, 16, 8))
    pos = jnp.zeros((1, 4, 16), jnp.int32)
    qpos = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        buffer_attention(q, keys, keys, pos, qpos, 4)
    with pytest.raises(ValueError, match="slot_positions"):
        buffer_attention(jnp.zeros((1, 1, 8, 8)), keys, keys, pos[:, :, :8], qpos, 4)
    with pytest.raises(ValueError, match="block_size"):
        buffer_attention(jnp.zeros((1, 1, 8, 8)), keys, keys, pos, qpos, 4, block_size=0)


# A pool of shapes (each compiles once), every runtime quantity drawn freely: fills per row,
# n_filled (may exceed every fill), hole density, contents.
SWEEP_SHAPES = [
    (1, 1, 4, 1, 1, 8, 16),  # a single slot
    (2, 3, 4, 2, 45, 8, 7),  # 45 = 6 * 7 + 3: clamped tail
    (3, 2, 3, 3, 70, 4, 16),  # MHA, 70 = 4 * 16 + 6
    (2, 2, 8, 2, 33, 8, 1),  # one slot per step
]


@settings(max_examples=20, deadline=None)
@given(data=st.data(), shape=st.sampled_from(SWEEP_SHAPES), hole_frac=st.sampled_from([0.0, 0.3, 0.9]))
def test_property_sweep(data, shape, hole_frac):
    b, t, h, kv, s, d, block = shape
    fills = tuple(data.draw(st.integers(0, s), label=f"fill{i}") for i in range(b))
    n = data.draw(st.integers(max(fills), s), label="n_filled")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    q, keys, values, pos, qpos = make_buffer(rng, b, t, h, kv, s, d, fills, hole_frac=hole_frac)
    out = attend(q, keys, values, pos, qpos, jnp.int32(n), block_size=block)
    np.testing.assert_allclose(np.asarray(out), reference(q, keys, values, pos, qpos, n), atol=1e-5, rtol=1e-5)


@DTYPES
def test_compiled_loop_does_not_touch_the_whole_buffer(dtype):
    """No convert / copy / fusion produces a capacity-sized array (XLA:CPU once hoisted a float32
    convert of the whole bf16 buffer out of the loop: a cost that follows capacity, not fill)."""
    b, kv, s, d = 2, 2, 4096, 8
    keys = jnp.zeros((b, kv, s, d), dtype)
    args = (jnp.zeros((b, 1, 4, d), dtype), keys, keys, jnp.zeros((b, kv, s), jnp.int32), jnp.zeros((b, 1), jnp.int32))
    if jax.default_backend() == "cpu" and dtype != jnp.float32:  # held as bits there, as the decode loop does
        args = (args[0], to_bits(keys), to_bits(keys), *args[3:])
        bits_of = dtype
    else:
        bits_of = None
    hlo = attend.lower(*args, jnp.int32(100), block_size=64, bits_of=bits_of).compile().as_text()
    assert not re.findall(rf"= \w+\[{b},{kv},{s},{d}\]\{{[^}}]*\}} (?:convert|copy|fusion)\(", hlo)


@pytest.mark.parametrize("stacked", [False, True], ids=["one layer", "stacked"])
def test_buffer_held_as_bits_gives_the_same_attention(stacked):
    """A bfloat16 buffer handed over as its uint16 bits (`bits_of`, the CPU decode loop's form)
    attends exactly as the bfloat16 buffer itself: each block is the same data, bitcast back."""
    rng = np.random.default_rng(3)
    b, t, h, kv, s, d = 2, 1, 4, 2, 100, 8
    q, keys, values, pos, qpos = make_buffer(rng, b, t, h, kv, s, d, (90, 57), hole_frac=0.2)
    q, keys, values = (x.astype(jnp.bfloat16) for x in (q, keys, values))
    layer = None
    if stacked:  # the stacked [l, ...] buffer, layer 1 read
        keys, values, pos = (jnp.stack([jnp.zeros_like(x), x]) for x in (keys, values, pos))
        layer = jnp.int32(1)
    kw = dict(block_size=32, layer=layer)
    want = buffer_attention(q, keys, values, pos, qpos, jnp.int32(90), **kw)
    got = buffer_attention(q, to_bits(keys), to_bits(values), pos, qpos, jnp.int32(90), bits_of=jnp.bfloat16, **kw)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="bits_of"):  # floats where bits were announced
        buffer_attention(q, keys, values, pos, qpos, jnp.int32(90), bits_of=jnp.bfloat16, **kw)
    with pytest.raises(ValueError, match="bits_of"):  # not a 16-bit float
        buffer_attention(q, to_bits(keys), to_bits(values), pos, qpos, jnp.int32(90), bits_of=jnp.float32, **kw)


def test_stacked_buffer_with_layer_index_reads_that_layer():
    """`layer=` on a stacked [l, ...] buffer equals passing that layer's slice."""
    rng = np.random.default_rng(7)
    l, b, t, h, k, s, d = 3, 2, 1, 4, 2, 40, 8
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((l, b, k, s, d)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((l, b, k, s, d)), jnp.float32)
    positions = jnp.asarray(np.where(rng.random((l, b, k, s)) < 0.8, np.arange(s), -1), jnp.int32)
    qpos = jnp.full((b, t), s, jnp.int32)
    for layer in range(l):
        stacked = buffer_attention(q, keys, values, positions, qpos, 33, block_size=16, layer=jnp.int32(layer))
        sliced = buffer_attention(q, keys[layer], values[layer], positions[layer], qpos, 33, block_size=16)
        np.testing.assert_array_equal(np.asarray(stacked), np.asarray(sliced))
