"""Random Attention's eviction round: the Pallas kernel against the XLA paths, alone and in decoding.

    python -m randkv_jax.eval.bench_eviction [--layers 8] [--batch 4] [--kv-heads 8] [--budget 1024]
        [--window 64] [--interval I] [--prompt 512] [--iters 20] [--preset qwen3-4b|qwen3-32b|phi-4-reasoning]
        [--compact-head-dim 128] [--decode-model tiny|default|PATH] [--decode-rounds 8]
        [--decode-budget 256] [--decode-window 32] [--decode-interval I] [--decode-prompt 128] [--skip-decode]

Budgets follow `randkv_jax.rule`: T = `--budget` entries per (layer, row, KV head) right after a
round, the window of w = `--window` newest entries and the pinned prompt included; a round every
i = `--interval` generated tokens (default: w), K_sel = T - w.

Part 1, one eviction round's keep mask on a buffer at the moment of a round (every row due: S =
max(P, T) + i slots, all full: the min(P, K_sel - 1) pinned prompt entries, the window, older
survivors), each jitted, then `iters` calls ended by `block_until_ready`, best of 3 rounds, ms per call:
  1. pallas:       `RandomAttention(backend="pallas").keep_mask` (interpret mode on CPU);
  2. xla argsort:  the shared `EvictionPolicy.keep_mask`'s `select_top` (stable argsort of -draw,
                   twice; `random_keep_mask_reference(method="argsort")`);
  3. xla top_k:    `lax.top_k(draws, K_sel)` then a scatter (`random_keep_mask_reference(method="top_k")`);
  4. xla bisect:   `backend="xla"`, the kernel's threshold bisection run by XLA over [l, b, k, s];
plus, for scale, `buffer.compact` (what follows every round; keys/values float32 of head_dim
`--compact-head-dim`, 128 by default, 0 skips it; jitted without donation, so each call also
copies the buffer once before moving its entries in place). All four masks are checked equal, and
to keep exactly T entries per head, before timing. Ratios are to (2).

Part 2, inside the decode loop: `generate` on a random-weight model (`tiny`: 4 layers, 8 KV heads,
or `default`: SmolLM2-135M float32, or a checkpoint path), batch `--batch`, prompt
`--decode-prompt`, T = `--decode-budget`, w = `--decode-window`, i = `--decode-interval`, greedy,
ignore_eos. The first chunk (the steps up to the first round, included: compile, fill, first
round) is not timed; the next `--decode-rounds` x i steps are (one eviction round every i steps).
Reported: ms per decode step for each variant, its ratio to xla argsort, and the rounds each row
went through (all of them, the untimed first one included). The four variants must generate the
same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from randkv_jax.rule import EvictionRule

PRESETS = {  # layers, KV heads (T = 2048, w = i = 64, batch 8, prompt 1024 -> S = 2112)
    "qwen3-4b": (36, 8),
    "qwen3-32b": (64, 8),
    "phi-4-reasoning": (40, 10),
}


@dataclasses.dataclass(frozen=True)
class XlaVariant(RandomAttention):
    """RandomAttention whose keep mask comes from `random_keep_mask_reference(method=...)` (XLA)."""

    method: str = "top_k"

    def keep_mask(self, buffer, row_seeds, observations=None, *, platform):
        keep = random_keep_mask_reference(
            buffer.positions, buffer.prompt_lens, buffer.generated, self.rule.n_select(buffer.prompt_lens),
            row_seeds, self.seed, rule=self.rule, shared_across_heads=self.shared_across_heads,
            slots_per_draw=self.slots_per_draw, method=self.method, max_select=self.rule.selected,
        )
        return jnp.where(self.due(buffer)[None, :, None, None], keep, buffer.valid)


def variants(budget: int, window: int, interval: int | None) -> dict[str, RandomAttention]:
    base = RandomAttention(budget=budget, window=window, interval=interval, seed=1)
    fields = dict(budget=budget, window=window, interval=interval, seed=1)
    return {
        "pallas": dataclasses.replace(base, backend="pallas"),
        "xla argsort": XlaVariant(**fields, method="argsort"),
        "xla top_k": XlaVariant(**fields, method="top_k"),
        "xla bisect": dataclasses.replace(base, backend="xla"),
    }


def round_buffer(rng, layers, batch, kv_heads, prompt, rule: EvictionRule, head_dim=1, dtype=jnp.float32):
    """A buffer at a round, every slot full: per head the pinned prompt, older survivors, the window."""
    generated = 8 * (rule.budget + rule.interval)  # a history longer than the buffer
    generated -= generated % rule.interval  # on the interval: every row is due
    s = max(prompt, rule.budget) + rule.interval  # `rule.capacity` with a long generation
    t, w = prompt + generated, rule.window
    n_pinned = int(rule.n_pinned(jnp.int32(prompt)))
    pos = np.empty((layers, batch, kv_heads, s), np.int32)
    for idx in np.ndindex(layers, batch, kv_heads):
        older = np.sort(rng.choice(np.arange(n_pinned, t - w), size=s - n_pinned - w, replace=False))
        pos[idx] = np.concatenate([np.arange(n_pinned), older, np.arange(t - w, t)])
    shape = (layers, batch, kv_heads, s, head_dim)
    kv = jnp.asarray(rng.standard_normal(shape), dtype)
    full = jnp.full((batch,), s, jnp.int32)
    buf = KVBuffer(kv, kv, jnp.asarray(pos), jnp.full((batch,), prompt, jnp.int32), full,
                   jnp.full((batch,), generated, jnp.int32))
    return buf, jnp.arange(batch, dtype=jnp.int32) + 11


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


def bench_round(args, platform: str) -> list[tuple[str, float]]:
    rng = np.random.default_rng(0)
    policies = variants(args.budget, args.window, args.interval)
    rule = policies["xla argsort"].rule
    buf, seeds = round_buffer(rng, args.layers, args.batch, args.kv_heads, args.prompt, rule)
    assert bool(np.asarray(policies["xla argsort"].due(buf)).all()), "every row is due"
    masks, rows = {}, []
    for name, policy in policies.items():
        fn = jax.jit(functools.partial(policy.keep_mask, platform=platform))
        masks[name] = np.asarray(fn(buf, seeds))
        rows.append((name, time_ms(fn, (buf, seeds), args.iters)))
    ref = masks["xla argsort"]
    for name, mask in masks.items():
        assert np.array_equal(mask, ref), f"{name} keeps other slots than xla argsort"
    assert (ref.sum(-1) == args.budget).all(), "a round keeps exactly T entries per head"
    if args.compact_head_dim:
        d = args.compact_head_dim
        big, _ = round_buffer(rng, args.layers, args.batch, args.kv_heads, args.prompt, rule, head_dim=d)
        rows.append((f"compact (d={d} f32, buffer copied)", time_ms(jax.jit(compact), (big, jnp.asarray(ref)),
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
    policies = variants(args.budget, args.window, args.interval)
    rule = policies["xla argsort"].rule
    # steps up to the first round (compile + fill + that round, not timed): the first multiple of
    # the interval at which the row holds more than T
    first = rule.interval * max(1, -(-(rule.budget + 1 - args.prompt) // rule.interval))
    steps = first + args.decode_rounds * rule.interval
    rows, tokens = [], {}
    for name, policy in policies.items():
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
    parser.add_argument("--budget", type=int, default=1024, help="T: entries per head after a round, window included")
    parser.add_argument("--window", type=int, default=64, help="w: newest entries never evicted")
    parser.add_argument("--interval", type=int, default=None, help="i: generated tokens between rounds (default: w)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compact-head-dim", type=int, default=128, help="0: do not time compact")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a model's round shape: T=2048 w=i=64 batch 8 prompt 1024")
    parser.add_argument("--decode-model", default="tiny", help="tiny | default (SmolLM2-135M) | a checkpoint path")
    parser.add_argument("--decode-rounds", type=int, default=8)
    parser.add_argument("--decode-budget", type=int, default=256, help="T in the decode loop")
    parser.add_argument("--decode-window", type=int, default=32, help="w in the decode loop")
    parser.add_argument("--decode-interval", type=int, default=None, help="i in the decode loop (default: w)")
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args(argv)
    if args.preset:
        args.layers, args.kv_heads = PRESETS[args.preset]
        args.budget, args.window, args.interval, args.batch, args.prompt = 2048, 64, 64, 8, 1024
    args.interval = args.interval or args.window

    device = jax.devices()[0]
    interpret = device.platform == "cpu"
    rule = EvictionRule(args.budget, args.window, args.interval)
    s = max(args.prompt, args.budget) + args.interval
    print(f"device={device.platform}:{device.device_kind} jax={jax.__version__} "
          f"pallas={'interpret mode' if interpret else 'compiled'}")
    print(f"eviction round: layers={args.layers} batch={args.batch} kv_heads={args.kv_heads} "
          f"T={args.budget} w={args.window} i={args.interval} K_sel={rule.selected} prompt={args.prompt} S={s} "
          f"iters={args.iters}")
    rows = bench_round(args, device.platform)
    base = dict(rows)["xla argsort"]
    print(f"{'':32s} {'ms/round':>10s} {'vs 2.':>7s} {'ms/step (/i)':>13s}")
    for i, (name, ms) in enumerate(rows, 1):
        print(f"{i}. {name:29s} {ms:10.3f} {ms / base:6.2f}x {ms / args.interval:13.4f}")

    if args.skip_decode:
        return
    decode_args = argparse.Namespace(**{**vars(args), "budget": args.decode_budget, "window": args.decode_window,
                                        "interval": args.decode_interval or args.decode_window,
                                        "prompt": args.decode_prompt})
    model, drows = bench_decode(decode_args)
    c = model.config
    print(f"\ndecode loop: model={args.decode_model} ({c.num_layers} layers, {c.num_kv_heads} KV heads, "
          f"head_dim {c.head_dim}, float32) batch={args.batch} prompt={args.decode_prompt} "
          f"T={args.decode_budget} w={args.decode_window} i={decode_args.interval}, "
          f"timed {args.decode_rounds} rounds x i steps")
    dbase = dict((n, ms) for n, ms, _ in drows)["xla argsort"]
    print(f"{'':32s} {'ms/step':>10s} {'vs 2.':>7s} {'rounds/row':>11s}")
    for i, (name, ms, ev) in enumerate(drows, 1):
        print(f"{i}. {name:29s} {ms:10.3f} {ms / dbase:6.2f}x {ev[0]:11d}")


if __name__ == "__main__":
    main()
