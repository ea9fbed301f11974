"""`buffer.compact`: the kept slots of every (layer, row, head) moved to the front in their old
order, checked against NumPy's stable argsort (the definition) on random masks with holes; and
the bfloat16 decode program moving the buffer's data as bits (`models.bits.moved_as_bits`)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from randkv_jax.buffer import KVBuffer, compact
from randkv_jax.decode import DecodeSpec, decode_chunk, empty_state
from randkv_jax.models.decoder import unstack_layers
from randkv_jax.policies import FullAttention, RandomAttention
from randkv_jax.sampling import SamplingParams


@pytest.mark.parametrize("block", [128, 8, 1], ids=["one-block", "blocks-last-clamped", "slot-by-slot"])
def test_compact_equals_a_stable_argsort_of_the_keep_mask(block):
    rng = np.random.default_rng(0)
    l, b, k, s, d = 2, 3, 4, 37, 5
    positions = np.where(rng.random((l, b, k, s)) < 0.8, rng.permutation(l * b * k * s).reshape(l, b, k, s), -1)
    keys = rng.standard_normal((l, b, k, s, d)).astype(np.float32)
    values = rng.standard_normal((l, b, k, s, d)).astype(np.float32)
    # every (layer, head) of a row keeps the same count (the round's contract): row r keeps 10 + 5r
    keep = np.zeros((l, b, k, s), bool)
    for idx in np.ndindex(l, b, k):
        valid = np.flatnonzero(positions[idx] >= 0)
        keep[idx][rng.choice(valid, 10 + 5 * idx[1], replace=False)] = True
    keep |= (rng.random(keep.shape) < 0.3) & (positions < 0)  # empty slots are never kept, even if asked
    buf = KVBuffer(jnp.asarray(keys), jnp.asarray(values), jnp.asarray(positions, jnp.int32),
                   prompt_lens=jnp.zeros((b,), jnp.int32), fill=jnp.full((b,), s, jnp.int32),
                   generated=jnp.zeros((b,), jnp.int32))

    out, order = jax.jit(compact, static_argnames="block")(buf, jnp.asarray(keep), block=block)

    kept = keep & (positions >= 0)
    want_order = np.argsort(~kept, axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(order), want_order)
    n = kept.sum(-1)
    np.testing.assert_array_equal(np.asarray(out.fill), n[0, :, 0])
    in_use = np.arange(s) < n[..., None]
    gathered = np.take_along_axis(positions, want_order, axis=-1)
    np.testing.assert_array_equal(np.asarray(out.positions), np.where(in_use, gathered, -1))
    for name, x in (("keys", keys), ("values", values)):  # the freed slots' contents are unspecified
        got = np.where(in_use[..., None], np.asarray(getattr(out, name)), 0)
        want = np.where(in_use[..., None], np.take_along_axis(x, want_order[..., None], axis=-2), 0)
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_compaction_in_the_decode_program_moves_the_buffer_in_place(tiny_model):
    """The decode loop's round compacts keys and values within the loop's own buffer: no float32
    array of the buffer's shape is copied (a whole-array gather wrote a new buffer and XLA copied
    it back into the loop's, every round)."""
    spec = DecodeSpec(tiny_model.config, jnp.float32, RandomAttention(budget=24, window=8), SamplingParams(), 8,
                      "cpu", unstacked=True)
    state = empty_state(spec, 2, 384)  # three blocks of 128 (one block would be the whole buffer)
    hlo = decode_chunk.lower(unstack_layers(tiny_model.params), state, jnp.int32(8), spec=spec).compile().as_text()
    dims = ",".join(map(str, state.buffer.keys.shape))
    assert f"f32[{dims}]" in hlo
    copies = [line for line in hlo.splitlines() if f"f32[{dims}]" in line.split("copy(")[0] and " copy(" in line]
    assert not copies, copies


def _in_bfloat16(model):
    return dataclasses.replace(model, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params),
                               dtype=jnp.bfloat16)


@pytest.mark.parametrize("unstacked", [True, False], ids=["unstacked", "scanned"])
def test_bfloat16_decode_program_never_widens_the_buffer(tiny_model, unstacked):
    """The compiled bfloat16 decode loop under Random Attention (appends, rounds, compaction) holds
    no float32 array of the KV buffer's shape: XLA:CPU converted the whole buffer to float32 and
    back around every 16-bit scatter and gather (`models.bits.moved_as_bits`); nor of a layer's
    weights (`decoder.project`). (A scoring policy's
    round legitimately scores the keys in float32, once a round.)"""
    model = _in_bfloat16(tiny_model)
    policy = RandomAttention(budget=24, window=8)
    spec = DecodeSpec(model.config, jnp.bfloat16, policy, SamplingParams(), 8, "cpu", unstacked=unstacked)
    state = empty_state(spec, 2, 64)
    params = unstack_layers(model.params) if unstacked else model.params
    hlo = decode_chunk.lower(params, state, jnp.int32(8), spec=spec).compile().as_text()
    dims = ",".join(map(str, state.buffer.keys.shape))
    assert state.buffer.keys.dtype == jnp.bfloat16 and f"bf16[{dims}]" in hlo  # the check looks at the buffer
    assert f"f32[{dims}]" not in hlo, f"a float32 copy of the bf16 [{dims}] buffer in the decode program"
    # nor of any layer weight: XLA:CPU converted both operands of a bf16 dot (`decoder.project`)
    for weight in jax.tree.leaves(params):
        if weight.ndim >= 2 + (not unstacked):
            dims = ",".join(map(str, weight.shape[not unstacked:]))
            assert f"f32[{dims}]" not in hlo, f"a float32 copy of a bf16 [{dims}] weight in the decode program"


@pytest.mark.parametrize("unstacked", [True, False], ids=["unstacked", "scanned"])
def test_bfloat16_decode_step_appends_and_attends_on_the_bits(tiny_model, unstacked):
    """The bf16 buffer is bitcast to its uint16 bits and back once per step, not per layer: each
    layer's append and attention work on the bits (`decode._decode_attend`). A bitcast back to
    bf16 between a layer's append and its attention was materialised: a copy of the whole buffer
    per layer and step (measured on 2 CPU cores, SmolLM2-135M: 94 ms of a step's thread time)."""
    model = _in_bfloat16(tiny_model)
    spec = DecodeSpec(model.config, jnp.bfloat16, FullAttention(), SamplingParams(), 8, "cpu", unstacked=unstacked)
    state = empty_state(spec, 2, 256)  # two blocks of 128
    params = unstack_layers(model.params) if unstacked else model.params
    hlo = decode_chunk.lower(params, state, jnp.int32(8), spec=spec).compile().as_text()
    dims = ",".join(map(str, state.buffer.keys.shape))
    bitcasts = re.findall(rf"= \w+\[{dims}\]\{{[^}}]*\}} bitcast-convert\(", hlo)
    assert len(bitcasts) <= 4 < 2 + 2 * model.config.num_layers, bitcasts  # keys and values, in and out
