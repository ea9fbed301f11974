"""The `randkv` command line: `randkv convert SRC --out DIR`, `randkv info [PATH]`."""

from __future__ import annotations

import argparse
import sys
import time


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="randkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a HF/GGUF checkpoint to randkv's Orbax format")
    convert.add_argument("src", help="HF checkpoint directory or .gguf file")
    convert.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    convert.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    convert.set_defaults(run=_convert)

    info = sub.add_parser("info", help="describe a checkpoint (default: the embedded model)")
    info.add_argument("path", nargs="?", default=None)
    info.set_defaults(run=_info)
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
