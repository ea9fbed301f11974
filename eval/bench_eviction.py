"""Random Attention's eviction round: the Pallas kernel against the XLA paths, alone and in decoding.

    python -m randkv_jax.eval.bench_eviction [--layers 8] [--batch 4] [--kv-heads 8] [--budget 1024]
        [--buffer 64] [--prompt 512] [--iters 20] [--preset qwen3-4b|qwen3-32b|phi-4-reasoning]
        [--compact-head-dim 128] [--decode-model tiny|default|PATH] [--decode-rounds 8]
        [--decode-budget 256] [--decode-buffer 32] [--decode-prompt 128] [--skip-decode]

Part 1, one eviction round's keep mask on a buffer at the moment of a round (every row due: prompt
P, K + r candidates, a window of r, S = P + K + 2r slots), each jitted, then `iters` calls ended by
`block_until_ready`, best of 3 rounds, ms per call:
  1. pallas:       `RandomAttention(backend="pallas").keep_mask` (interpret mode on CPU);
  2. xla argsort:  `backend="xla"`, the shared `select_top` (stable argsort of -draw, twice);
  3. xla top_k:    `lax.top_k(draws, K)` then a scatter (`random_keep_mask_reference(method="top_k")`);
  4. xla bisect:   the kernel's threshold bisection run by XLA over [l, b, k, s];
plus, for scale, `buffer.compact` (the gather that follows every round; keys/values float32 of
head_dim `--compact-head-dim`, 128 by default, 0 skips it). All four masks are checked equal
before timing. Ratios are to (2).

Part 2, inside the decode loop: `generate` on a random-weight model (`tiny`: 4 layers, 8 KV heads,
or `default`: SmolLM2-135M float32, or a checkpoint path), batch `--batch`, prompt
`--decode-prompt`, K = `--decode-budget`, r = `--decode-buffer`, greedy, ignore_eos. The first chunk
(K + 2r steps: compile, fill, first round) is not timed; the next `--decode-rounds` x r steps are (one
eviction round every r steps). Reported: ms per decode step for each variant, its ratio to xla
argsort, and the rounds each row went through (all of them, the untimed first one included). The
four variants must generate the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import randkv_jax
from randkv_jax.buffer import KVBuffer, compact
from randkv_jax.kernels.random_keep import random_keep_mask_reference
from randkv_jax.models.config import ModelConfig, RopeConfig
from randkv_jax.models.model import Model, init_params
from randkv_jax.policies import RandomAttention
from randkv_jax.policies.base import parse_protect

PRESETS = {  # layers, KV heads (K = 2048, r = 64, batch 8, prompt 1024 -> S = 3200)
    "qwen3-4b": (36, 8),
    "qwen3-32b": (64, 8),
    "phi-4-reasoning": (40, 10),
}


@dataclasses.dataclass(frozen=True)
class XlaVariant(RandomAttention):
    """RandomAttention whose keep mask comes from `random_keep_mask_reference(method=...)` (XLA)."""

    method: str = "top_k"

    def keep_mask(self, buffer, n_generated, row_seeds, observations=None):
        keep = random_keep_mask_reference(
            buffer.positions, buffer.prompt_lens, self.kept_per_row(buffer.prompt_lens), row_seeds, self.seed,
            n_generated, buffer=self.buffer, sinks=parse_protect(self.protect),
            shared_across_heads=self.shared_across_heads, block_size=self.block_size, method=self.method,
            max_kept=self.max_kept,
        )
        return jnp.where(self.due(buffer, n_generated)[None, :, None, None], keep, buffer.valid)


def variants(budget: int, buffer: int) -> dict[str, RandomAttention]:
    base = RandomAttention(budget=budget, buffer=buffer, seed=1)
    return {
        "pallas": dataclasses.replace(base, backend="pallas"),
        "xla argsort": dataclasses.replace(base, backend="xla"),
        "xla top_k": XlaVariant(budget=budget, buffer=buffer, seed=1, method="top_k"),
        "xla bisect": XlaVariant(budget=budget, buffer=buffer, seed=1, method="bisect"),
    }


def round_buffer(rng, layers, batch, kv_heads, prompt, budget, r, head_dim=1, dtype=jnp.float32):
    """A buffer at a round: per head the prompt, K surviving older tokens, the last 2r tokens."""
    s = prompt + budget + 2 * r
    n_generated = 8 * (budget + r)  # a multiple of r, with a history longer than the buffer
    n_generated -= n_generated % r
    pos = np.empty((layers, batch, kv_heads, s), np.int32)
    older = n_generated - 2 * r
    for idx in np.ndindex(layers, batch, kv_heads):
        kept = np.sort(rng.choice(older, size=budget, replace=False))
        pos[idx] = np.concatenate([np.arange(prompt), prompt + kept, prompt + np.arange(older, n_generated)])
    shape = (layers, batch, kv_heads, s, head_dim)
    kv = jnp.asarray(rng.standard_normal(shape), dtype)
    buf = KVBuffer(kv, kv, jnp.asarray(pos), jnp.full((batch,), prompt, jnp.int32), jnp.full((batch,), s, jnp.int32))
    return buf, jnp.int32(n_generated), jnp.arange(batch, dtype=jnp.int32) + 11


def time_ms(fn, args, iters: int, rounds: int = 3) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            jax.block_until_ready(fn(*args))
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def bench_round(args) -> list[tuple[str, float]]:
    rng = np.random.default_rng(0)
    buf, n, seeds = round_buffer(rng, args.layers, args.batch, args.kv_heads, args.prompt, args.budget, args.buffer)
    masks, rows = {}, []
    for name, policy in variants(args.budget, args.buffer).items():
        fn = jax.jit(policy.keep_mask)
        masks[name] = np.asarray(fn(buf, n, seeds))
        rows.append((name, time_ms(fn, (buf, n, seeds), args.iters)))
    ref = masks["xla argsort"]
    assert bool(np.asarray(variants(args.budget, args.buffer)["xla argsort"].due(buf, n)).all()), "every row is due"
    for name, mask in masks.items():
        assert np.array_equal(mask, ref), f"{name} keeps other slots than xla argsort"
    assert (ref.sum(-1) == args.prompt + args.budget + args.buffer).all()
    if args.compact_head_dim:
        d = args.compact_head_dim
        big, _, _ = round_buffer(rng, args.layers, args.batch, args.kv_heads, args.prompt, args.budget, args.buffer,
                                 head_dim=d)
        rows.append((f"compact (gather, d={d} f32)", time_ms(jax.jit(compact), (big, jnp.asarray(ref)),
                                                             max(1, args.iters // 4))))
    return rows


def decode_model(name: str) -> Model:
    if name == "tiny":
        config = ModelConfig(
            architecture="Qwen3ForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=512,
            num_layers=4, num_heads=16, num_kv_heads=8, head_dim=32, rms_norm_eps=1e-6,
            rope=RopeConfig(theta=1e6), max_position_embeddings=1 << 16, tie_word_embeddings=True, qk_norm=True,
        )
        return Model(config, init_params(config, jax.random.key(0)), None, jnp.float32)
    return randkv_jax.load_model(None if name == "default" else name, dtype="float32")


def bench_decode(args) -> tuple[Model, list[tuple[str, float, list[int]]]]:
    model = decode_model(args.decode_model)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.config.vocab_size, size=args.prompt).tolist() for _ in range(args.batch)]
    first = args.budget + 2 * args.buffer  # steps before the first round: compile + fill, not timed
    steps = first + args.decode_rounds * args.buffer
    rows, tokens = [], {}
    for name, policy in variants(args.budget, args.buffer).items():
        out = randkv_jax.generate(model, prompts, policy=policy, max_new_tokens=steps + 1, chat=False,
                                  ignore_eos=True, chunk=first)
        tokens[name] = out.tokens
        rows.append((name, 1e3 * out.decode_seconds / max(out.decode_steps, 1), [s.evictions for s in out.stats]))
    for name, toks in tokens.items():
        assert toks == tokens["xla argsort"], f"{name} generated other tokens"
    return model, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024, help="K")
    parser.add_argument("--buffer", type=int, default=64, help="r")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compact-head-dim", type=int, default=128, help="0: do not time compact")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a model's round shape: K=2048 r=64 batch 8 prompt 1024")
    parser.add_argument("--decode-model", default="tiny", help="tiny | default (SmolLM2-135M) | a checkpoint path")
    parser.add_argument("--decode-rounds", type=int, default=8)
    parser.add_argument("--decode-budget", type=int, default=256, help="K in the decode loop")
    parser.add_argument("--decode-buffer", type=int, default=32, help="r in the decode loop")
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args(argv)
    if args.preset:
        args.layers, args.kv_heads = PRESETS[args.preset]
        args.budget, args.buffer, args.batch, args.prompt = 2048, 64, 8, 1024

    device = jax.devices()[0]
    interpret = jax.default_backend() == "cpu"
    s = args.prompt + args.budget + 2 * args.buffer
    print(f"device={device.platform}:{device.device_kind} jax={jax.__version__} "
          f"pallas={'interpret mode' if interpret else 'compiled'}")
    print(f"eviction round: layers={args.layers} batch={args.batch} kv_heads={args.kv_heads} "
          f"K={args.budget} r={args.buffer} prompt={args.prompt} S={s} iters={args.iters}")
    rows = bench_round(args)
    base = dict(rows)["xla argsort"]
    print(f"{'':32s} {'ms/round':>10s} {'vs 2.':>7s} {'ms/step (/r)':>13s}")
    for i, (name, ms) in enumerate(rows, 1):
        print(f"{i}. {name:29s} {ms:10.3f} {ms / base:6.2f}x {ms / args.buffer:13.4f}")

    if args.skip_decode:
        return
    decode_args = argparse.Namespace(**{**vars(args), "budget": args.decode_budget, "buffer": args.decode_buffer,
                                        "prompt": args.decode_prompt})
    model, drows = bench_decode(decode_args)
    c = model.config
    print(f"\ndecode loop: model={args.decode_model} ({c.num_layers} layers, {c.num_kv_heads} KV heads, "
          f"head_dim {c.head_dim}, float32) batch={args.batch} prompt={args.decode_prompt} "
          f"K={args.decode_budget} r={args.decode_buffer}, timed {args.decode_rounds} rounds x r steps")
    dbase = dict((n, ms) for n, ms, _ in drows)["xla argsort"]
    print(f"{'':32s} {'ms/step':>10s} {'vs 2.':>7s} {'rounds/row':>11s}")
    for i, (name, ms, ev) in enumerate(drows, 1):
        print(f"{i}. {name:29s} {ms:10.3f} {ms / dbase:6.2f}x {ev[0]:11d}")


if __name__ == "__main__":
    main()
