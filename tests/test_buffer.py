"""`buffer.compact`: the kept slots of every (layer, row, head) moved to the front in their old
order, checked against NumPy's stable argsort (the definition) on random masks with holes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from randkv_jax.buffer import KVBuffer, compact


def test_compact_equals_a_stable_argsort_of_the_keep_mask():
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

    out, order = compact(buf, jnp.asarray(keep))

    kept = keep & (positions >= 0)
    want_order = np.argsort(~kept, axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(order), want_order)
    n = kept.sum(-1)
    np.testing.assert_array_equal(np.asarray(out.fill), n[0, :, 0])
    in_use = np.arange(s) < n[..., None]
    gathered = np.take_along_axis(positions, want_order, axis=-1)
    np.testing.assert_array_equal(np.asarray(out.positions), np.where(in_use, gathered, -1))
    for name, x in (("keys", keys), ("values", values)):
        np.testing.assert_array_equal(np.asarray(getattr(out, name)),
                                      np.take_along_axis(x, want_order[..., None], axis=-2), err_msg=name)
