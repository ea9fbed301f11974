"""Continuous batching against static batching on a long-tailed workload, side by side in one run.

    python -m randkv_jax.eval.bench_engine [--quick] [--model PATH]

The workload (fixed here, so every run measures the same thing): REQUESTS requests in arrival
order, each with a prompt from PROMPTS and a generation length drawn from a log-normal
(log-mean LOG_MEAN, log-sigma LOG_SIGMA, seed SEED) clipped to [MIN_LEN, MAX_LEN]; EOS is
ignored, so every request produces exactly its length (the useful tokens). Greedy decoding under
RandomAttention(budget=BUDGET, buffer=WINDOW) on the embedded SmolLM2-135M-Instruct, float32.

  - engine: one `Engine` with SLOTS slots; a finished request's slot takes the next request;
  - static: `generate` on groups of SLOTS requests in arrival order: each group decodes until
    its longest request is done.

Both use the same capacity and chunk, so each request runs in the same engine shape either way
and its tokens are checked equal. Both paths are compiled by a warm-up run before timing. Printed:
wall time, useful tokens/s, their ratio, the ideal ratio (sum of group maxima x SLOTS / sum of
lengths: what static batching spends in slot-steps per useful token), and eviction rounds per
1000 useful tokens (rounds are batched over the slots: refilling must not make them more frequent).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from randkv_jax.engine import Engine, encode_prompt
from randkv_jax.generate import generate
from randkv_jax.models.loading import load_model
from randkv_jax.policies import RandomAttention

SLOTS = 8
SEED = 0
LOG_MEAN, LOG_SIGMA = 5.3, 0.8  # median exp(5.3) = 200 tokens, mean about 275 before clipping
BUDGET, WINDOW = 256, 64
CHUNK = 64
SIZES = {"full": dict(requests=64, min_len=32, max_len=2048), "quick": dict(requests=24, min_len=32, max_len=512)}
PROMPTS = (
    "Explain step by step how to compute 17 * 23.",
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system and describe each one.",
    "Why is the sky blue? Explain in detail.",
    "Describe how a bicycle works.",
    "What are the main causes of the seasons on Earth?",
    "Write a poem about the sea.",
    "How do you bake bread? Give every step.",
)


def workload(requests: int, min_len: int, max_len: int) -> list[int]:
    rng = np.random.default_rng(SEED)
    return np.clip(np.round(rng.lognormal(LOG_MEAN, LOG_SIGMA, size=requests)), min_len, max_len).astype(int).tolist()


def run_engine(model, prompts, lengths, capacity):
    engine = Engine(model, policy=RandomAttention(budget=BUDGET, buffer=WINDOW), slots=SLOTS, capacity=capacity,
                    chunk=CHUNK)
    ids = [engine.submit(p, max_new_tokens=n, seed=i, ignore_eos=True, chat=False)[0]
           for i, (p, n) in enumerate(zip(prompts, lengths))]
    done = {c.request_id: c.tokens for c in engine.run()}
    return [done[i] for i in ids], int(engine.state.rounds_run)


def run_static(model, prompts, lengths, capacity):
    tokens, rounds = [], 0
    for start in range(0, len(prompts), SLOTS):
        out = generate(model, prompts[start:start + SLOTS], policy=RandomAttention(budget=BUDGET, buffer=WINDOW),
                       max_new_tokens=max(lengths[start:start + SLOTS]), seed=list(range(start, start + SLOTS)),
                       chat=False, ignore_eos=True, capacity=capacity, chunk=CHUNK, return_state=True)
        # a row stops at its own length: cut what it would have generated past it
        tokens += [t[:n] for t, n in zip(out.tokens, lengths[start:start + SLOTS])]
        rounds += int(out.state.rounds_run)
    return tokens, rounds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="24 requests clipped to [32, 512] (a few minutes)")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    lengths = workload(**size)
    model = load_model(args.model, dtype="float32")
    prompts = [encode_prompt(model, PROMPTS[i % len(PROMPTS)], chat=True) for i in range(len(lengths))]
    policy = RandomAttention(budget=BUDGET, buffer=WINDOW)
    capacity = -(-policy.capacity(max(map(len, prompts)), max(lengths)) // 128) * 128
    groups = [lengths[i:i + SLOTS] for i in range(0, len(lengths), SLOTS)]
    ideal = sum(max(g) * SLOTS for g in groups) / sum(lengths)
    print(f"workload: {len(lengths)} requests, lengths lognormal(log-mean {LOG_MEAN}, log-sigma {LOG_SIGMA}) "
          f"clipped to [{size['min_len']}, {size['max_len']}], seed {SEED}: sum {sum(lengths)}, mean "
          f"{np.mean(lengths):.0f}, median {np.median(lengths):.0f}, max {max(lengths)}; prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    print(f"model {model.config.architecture} ({model.config.num_layers} layers) float32, {SLOTS} slots, "
          f"capacity {capacity}, chunk {CHUNK}, {policy}")

    warm = [32] * SLOTS  # compile both paths on the same shapes before timing
    run_engine(model, prompts[:SLOTS], warm, capacity)
    run_static(model, prompts[:SLOTS], warm, capacity)

    results = {}
    for name, run in (("static generate (groups of 8)", run_static), ("engine", run_engine)):
        start = time.perf_counter()
        tokens, rounds = run(model, prompts, lengths, capacity)
        seconds = time.perf_counter() - start
        assert [len(t) for t in tokens] == lengths, name
        results[name] = (tokens, seconds, rounds)
    (static_tokens, static_s, static_rounds), (engine_tokens, engine_s, engine_rounds) = results.values()
    assert engine_tokens == static_tokens, "a request's tokens differ between the engine and static batching"
    useful = sum(lengths)
    print(f"\n{'':32s} {'wall s':>8s} {'useful tok/s':>13s} {'rounds/1k tok':>14s}")
    for name, (_, seconds, rounds) in results.items():
        print(f"{name:32s} {seconds:8.1f} {useful / seconds:13.1f} {1000 * rounds / useful:14.2f}")
    print(f"engine / static useful tokens/s: {static_s / engine_s:.2f}x (ideal, from the lengths alone: "
          f"{ideal:.2f}x); tokens identical per request")


if __name__ == "__main__":
    main()
