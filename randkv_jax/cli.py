"""The `randkv` command line: `generate`, `convert`, `info`, `calibrate`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _convert(args: argparse.Namespace) -> None:
    from randkv_jax.models.checkpoint import save_converted
    from randkv_jax.models.loading import load_model

    start = time.perf_counter()
    model = load_model(args.src, dtype=args.dtype)
    out = save_converted(model, args.out)
    print(
        f"converted {args.src} ({model.config.architecture}, {model.num_params:,} parameters, "
        f"{args.dtype}) to {out} in {time.perf_counter() - start:.1f} s"
    )


def _info(args: argparse.Namespace) -> None:
    from randkv_jax.models.loading import load_model

    model = load_model(args.path, dtype="float32")
    c = model.config
    print(f"{c.architecture}: {model.num_params:,} parameters, {c.num_layers} layers, "
          f"{c.num_heads}/{c.num_kv_heads} heads x {c.head_dim}, vocab {c.vocab_size}, "
          f"tokenizer: {'yes' if model.tokenizer else 'no'}")


def _calibrate(args: argparse.Namespace) -> None:
    from randkv_jax.calibration import calibrate_text, default_stats_dir
    from randkv_jax.models.loading import load_model

    if not Path(args.text).is_file():
        raise FileNotFoundError(f"calibration text not found: {args.text}")
    start = time.perf_counter()
    out = args.out or default_stats_dir(args.model)
    model = load_model(args.model, dtype=args.dtype)
    out = calibrate_text(model, args.text, out, max_tokens=args.max_tokens, chunk=args.chunk)
    print(f"TriAttention statistics of {args.model} ({args.text}) saved to {out} "
          f"in {time.perf_counter() - start:.1f} s")


DEMO_PROMPTS = (
    "What is 17 * 23? Think step by step.",
    "Write a short poem about the sea.",
    "Explain in three sentences why the sky is blue.",
)


def _policy(args: argparse.Namespace):
    """The policy named by --policy, given the options its dataclass has (others keep defaults)."""
    from randkv_jax import policies

    if args.convention is not None:
        raise ValueError(
            f"--convention is gone ({args.convention}): --budget is now the entries held per KV head after a "
            "round, prompt and window included (the engine's token_budget); the old text convention's "
            "--budget K is --selected K, the vLLM plugin's KV_BUDGET is --budget with --window and --interval"
        )
    if args.budget is not None and args.selected is not None:
        raise ValueError("give --budget (entries held, window included) or --selected (budget minus window), not both")
    if args.buffer is not None and (args.window is not None or args.interval is not None):
        raise ValueError("--buffer sets the window and the interval both: give it or --window/--interval, not both")
    window = next((v for v in (args.buffer, args.window) if v is not None), policies.EvictionPolicy.window)
    interval = next((v for v in (args.buffer, args.interval) if v is not None), window)
    budget = args.budget if args.selected is None else args.selected + window
    fields = policies.fields_of(args.policy)
    options = {"budget": budget, "window": window, "interval": interval, "protect": args.protect,
               "seed": args.seed, "preset": args.preset}
    kwargs = {k: v for k, v in options.items() if k in fields and v is not None}
    if "stats" in fields:
        from randkv_jax.calibration import default_stats_dir
        from randkv_jax.models.loading import default_model_dir

        kwargs["stats"] = args.stats or default_stats_dir(args.model or default_model_dir())
    return policies.get(args.policy, **kwargs)


def _generate(args: argparse.Namespace) -> None:
    from randkv_jax.engine import Engine, encode_prompt
    from randkv_jax.models.loading import DEFAULT_MODEL, load_model
    from randkv_jax.progress import ProgressBar

    policy = _policy(args)  # validate before the (slow) model load
    prompts = list(args.prompt) or list(DEMO_PROMPTS)
    print(f"model: {args.model or DEFAULT_MODEL}; policy: {policy}", flush=True)
    model = load_model(args.model, dtype=args.dtype)
    template_kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}
    ids = [encode_prompt(model, p, not args.no_chat, **template_kwargs) for p in prompts]
    engine = Engine(model, policy=policy, slots=args.slots or len(ids), max_prompt_tokens=max(map(len, ids)),
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, chunk=args.chunk)
    for i, p in enumerate(ids):
        engine.submit(p, seed=args.seed + i, chat=False)
    start = time.perf_counter()
    held = full = tokens = 0
    with ProgressBar(len(ids)) as bar:
        for done in engine.run(progress=bar.update):
            s = done.stats
            answer = done.text if done.text is not None else str(done.tokens)
            after = f", {s.held_after_round} entries per KV head after each" if s.evictions else ""
            print(f"\n### [{done.request_id}] {prompts[done.request_id]}\n{answer.strip()}")
            print(f"    ({s.new_tokens} new tokens, {s.finish_reason}, {s.evictions} eviction rounds{after}, "
                  f"peak {s.peak_slots} entries; first token after {s.first_token_seconds:.2f} s)")
            held, full, tokens = held + s.kv_bytes, full + s.kv_bytes_full, tokens + s.new_tokens
    wall = time.perf_counter() - start
    rate = (f"{engine.decode_tokens / engine.decode_seconds:.1f} tokens/s in {engine.steps} decode steps"
            if engine.steps else "no decode step ran")
    print(f"\ndecode: {rate} ({engine.slots} slots, {len(ids)} requests; {tokens / wall:.1f} tokens/s overall "
          f"with prefill, {engine.compile_seconds:.1f} s compiling before); KV memory {held / 2**20:.2f} MiB vs "
          f"{full / 2**20:.2f} MiB with a full cache ({100 * (1 - held / full):.0f}% saved)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="randkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate with a bounded KV cache (default: Random Attention)")
    gen.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    gen.add_argument("--policy", default="random", help="eviction policy name (see randkv_jax.policies)")
    gen.add_argument("--budget", type=int, default=None,
                     help="T: entries each KV head holds right after a round, prompt and window included "
                          "(the paper's K, its engine's token_budget; default 1024)")
    gen.add_argument("--selected", type=int, default=None,
                     help="the budget stated as its selected part: T = SELECTED + window (the probes' 'K=1024 + W=64')")
    gen.add_argument("--buffer", type=int, default=None, help="sets --window and --interval both (default 64)")
    gen.add_argument("--window", type=int, default=None, help="w: newest entries never evicted")
    gen.add_argument("--interval", type=int, default=None, help="i: generated tokens between rounds (default: window)")
    gen.add_argument("--protect", default=None,
                     help="prompt | sinks:N | none (default: the policy's published regime)")
    gen.add_argument("--preset", default=None, help="a policy's named preset (snapkv, rkv, vase: paper | ...)")
    gen.add_argument("--stats", default=None,
                     help="TriAttention statistics (default: <model>/triattention_stats from `randkv calibrate`)")
    gen.add_argument("--convention", default=None, help=argparse.SUPPRESS)  # refused with the new equivalent
    gen.add_argument("--max-new-tokens", type=int, default=512)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--enable-thinking", type=lambda v: v.lower() in ("1", "true", "yes"), default=None,
                     help="Qwen3 chat template switch (true/false)")
    gen.add_argument("--slots", type=int, default=None,
                     help="batch slots decoded together (default: one per prompt); more prompts than slots "
                          "queue, and a finished request's slot takes the next one")
    gen.add_argument("--chunk", type=int, default=64,
                     help="decode steps per device call (rounded up to a multiple of the policy's interval)")
    gen.set_defaults(run=_generate)

    convert = sub.add_parser("convert", help="convert a HF/GGUF checkpoint to randkv's Orbax format")
    convert.add_argument("src", help="HF checkpoint directory or .gguf file")
    convert.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    convert.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    convert.set_defaults(run=_convert)

    info = sub.add_parser("info", help="describe a checkpoint (default: the embedded model)")
    info.add_argument("path", nargs="?", default=None)
    info.set_defaults(run=_info)

    calib = sub.add_parser("calibrate", help="compute TriAttention's query statistics from plain text")
    calib.add_argument("--model", required=True, help="checkpoint directory or .gguf file")
    calib.add_argument("--text", required=True, help="plain-text file (UTF-8) encoded with the model's tokenizer")
    calib.add_argument("--out", default=None, help="output directory (default: <model>/triattention_stats)")
    calib.add_argument("--max-tokens", type=int, default=32768, help="use the text's first N tokens")
    calib.add_argument("--chunk", type=int, default=None,
                       help="tokens per forward sequence (default: all in one sequence)")
    calib.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    calib.set_defaults(run=_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"randkv: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
