"""Decode-step cost against buffer capacity: attention reads only the filled blocks.

    python -m randkv_jax.eval.bench_decode [--model PATH] [--batch 4] [--filled 1024]
        [--capacities 1152,16384] [--steps 32] [--dtype float32]

Fills every row with `filled` prompt tokens, then times `steps` FullAttention decode steps
(one jitted while_loop, after a warm-up chunk) for each buffer capacity, side by side in one run,
and prints ms per step and the ratio to the smallest capacity. A step whose cost followed the
capacity would grow ~linearly with it; here it should stay flat.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from randkv_jax.engine import Engine
from randkv_jax.models.loading import load_model
from randkv_jax.policies import FullAttention


def time_steps(model, capacity: int, batch: int, filled: int, steps: int) -> float:
    """Best ms per decode step over two chunks of `steps`, after a warm-up chunk."""
    engine = Engine(model, policy=FullAttention(), slots=batch, capacity=capacity, chunk=steps)
    rng = np.random.default_rng(0)
    for row in range(batch):
        engine.submit(rng.integers(10, model.config.vocab_size, size=filled).tolist(), max_new_tokens=3 * steps + 8,
                      seed=row, ignore_eos=True)
    engine.step()  # prefill, insert, the first chunk: compiles and warms up
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        engine.step()  # one chunk, synchronised (the host reads the tokens)
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--filled", type=int, default=1024)
    parser.add_argument("--capacities", default="1152,16384")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model = load_model(args.model, dtype=args.dtype)
    capacities = [int(c) for c in args.capacities.split(",")]
    print(f"device={jax.default_backend()} model={model.config.architecture} layers={model.config.num_layers} "
          f"dtype={args.dtype} batch={args.batch} filled={args.filled} steps={args.steps}")
    times = [time_steps(model, c, args.batch, args.filled, args.steps) for c in capacities]
    for capacity, ms in zip(capacities, times):
        print(f"FullAttention decode step, {args.filled} filled / {capacity:6d} slots: {ms:8.2f} ms/step "
              f"({ms / times[0]:.2f}x)")


if __name__ == "__main__":
    main()
