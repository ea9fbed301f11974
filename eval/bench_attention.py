"""One decode step's attention over a KV buffer: cost follows what is filled, not the capacity.

    python -m randkv_jax.eval.bench_attention [--dtype bfloat16|float32] [--iters 50]
        [--filled 1024] [--capacity 16384] [--block-size 256] [--batch 4] [--heads 16]
        [--kv-heads 8] [--head-dim 128]

Times, side by side in one run (jit, warm-up, then `iters` calls each ended by
`block_until_ready`; the best of 3 such rounds, in ms per call):
  1. `buffer_attention` with `filled` slots in a `capacity`-slot buffer (n_filled traced);
  2. `buffer_attention` with the same `filled` slots in a `filled`-slot buffer;
  3. dense (non-blocked) masked attention over the whole `capacity`-slot buffer,
and prints each one's ratio to (2). (1) / (2) near 1 means the blocked loop does not pay for the
empty capacity; (3) / (2) is what reading the whole buffer would cost.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from randkv_jax.attention import buffer_attention
from randkv_jax.models.bits import is_half, to_bits


def dense_attention(q, keys, values, slot_positions, query_positions):
    """Masked softmax over every slot of the buffer (the capacity-bound baseline)."""
    b, t, h, d = q.shape
    kv = keys.shape[1]
    qg = q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)  # [b, k, g, t, d]
    scores = jnp.einsum("bkgtd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32) * d**-0.5
    pos = slot_positions[:, :, None, None, :]
    visible = (pos >= 0) & (pos <= query_positions[:, None, None, :, None])
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    ctx = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return ctx.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def make_inputs(rng, args, capacity, dtype):
    b, h, kv, d, filled = args.batch, args.heads, args.kv_heads, args.head_dim, args.filled
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), dtype)
    keys = jnp.asarray(rng.standard_normal((b, kv, capacity, d)), dtype)
    values = jnp.asarray(rng.standard_normal((b, kv, capacity, d)), dtype)
    pos = np.full((b, kv, capacity), -1, np.int32)
    for bi in range(b):  # each head holds its own positions out of a longer history
        for ki in range(kv):
            pos[bi, ki, :filled] = np.sort(rng.choice(4 * filled, size=filled, replace=False))
    qpos = jnp.full((b, 1), 4 * filled, jnp.int32)
    return q, keys, values, jnp.asarray(pos), qpos


def time_ms(fn, inputs, iters: int, rounds: int = 3) -> float:
    for _ in range(3):
        fn(*inputs).block_until_ready()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn(*inputs).block_until_ready()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--filled", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    blocked = jax.jit(buffer_attention, static_argnames=("block_size", "bits_of"))
    dense = jax.jit(dense_attention)
    big = make_inputs(rng, args, args.capacity, dtype)
    small = tuple(x[:, :, : args.filled] if x.ndim >= 3 else x for x in big)  # same filled slots
    n = jnp.int32(args.filled)
    # on CPU a 16-bit buffer is held as its bits, as the decode loop holds it (`buffer_attention`)
    bits_of = dtype if jax.default_backend() == "cpu" and is_half(dtype) else None
    stored = (lambda q, k, v, p, qp: (q, to_bits(k), to_bits(v), p, qp)) if bits_of else (lambda *x: x)  # noqa: E731
    big_stored, small_stored = stored(*big), stored(*small)

    def run_blocked(q, k, v, p, qp):
        return blocked(q, k, v, p, qp, n, block_size=args.block_size, bits_of=bits_of)

    # the three compute the same thing on the same filled slots
    ref = np.asarray(run_blocked(*small_stored), np.float32)
    for name, out in [("big buffer", run_blocked(*big_stored)), ("dense", dense(*big))]:
        err = float(np.max(np.abs(np.asarray(out, np.float32) - ref)))
        assert err < (1e-2 if args.dtype == "bfloat16" else 1e-4), f"{name} differs by {err}"

    rows = [
        (f"blocked, {args.filled} filled / {args.capacity} slots", time_ms(run_blocked, big_stored, args.iters)),
        (f"blocked, {args.filled} filled / {args.filled} slots", time_ms(run_blocked, small_stored, args.iters)),
        (f"dense,   {args.filled} filled / {args.capacity} slots", time_ms(dense, big, args.iters)),
    ]
    base = rows[1][1]
    print(
        f"device={jax.devices()[0].device_kind} dtype={args.dtype} B={args.batch} H={args.heads} "
        f"Hkv={args.kv_heads} D={args.head_dim} T=1 block_size={args.block_size} iters={args.iters}"
    )
    print(f"{'':44s} {'ms/call':>9s} {'vs 2.':>7s}")
    for i, (name, ms) in enumerate(rows, 1):
        print(f"{i}. {name:41s} {ms:9.3f} {ms / base:6.2f}x")


if __name__ == "__main__":
    main()
