"""The `randkv` command line: `generate`, `convert`, `info`, `calibrate`, `eval`, `report`, `sweep`, `plan`,
`probe`."""

from __future__ import annotations

import argparse
import dataclasses
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


def _policy(args: argparse.Namespace, default_budget: int | None = None):
    """The policy named by --policy, given the options its dataclass has (others keep defaults);
    `default_budget` when neither --budget nor --selected is given (an eval preset)."""
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
    budget = default_budget if budget is None else budget
    fields = policies.fields_of(args.policy)
    options = {"budget": budget, "window": window, "interval": interval, "protect": args.protect,
               "seed": getattr(args, "seed", None), "preset": args.preset}
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
    from randkv_jax.sharding import parse_mesh

    policy = _policy(args)  # validate before the (slow) model load
    prompts = list(args.prompt) or list(DEMO_PROMPTS)
    print(f"model: {args.model or DEFAULT_MODEL}; policy: {policy}", flush=True)
    mesh = parse_mesh(args.mesh)
    model = load_model(args.model, dtype=args.dtype, mesh=mesh)
    template_kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}
    ids = [encode_prompt(model, p, not args.no_chat, **template_kwargs) for p in prompts]
    data = 1 if mesh is None else mesh.shape["data"]
    slots = args.slots or -(-len(ids) // data) * data
    engine = Engine(model, policy=policy, slots=slots, max_prompt_tokens=max(map(len, ids)),
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, chunk=args.chunk, mesh=mesh)
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


def _dataset(spec: str, limit: int | None):
    """--dataset NAME | FILE | NAME=FILE."""
    from randkv_jax.eval.datasets import DATASETS, load_dataset

    name, sep, path = spec.partition("=")
    if sep and name in DATASETS:
        return dataclasses.replace(load_dataset(path, limit=limit), name=name)
    return load_dataset(spec, limit=limit)


def _evaluate(model, model_path, dataset, policy_args, *, samples, max_new_tokens, seed, slots, chunk, sampling,
              template_kwargs, unsafe, out, progress=True, mesh=None, shard=None):
    """One run of `randkv eval` (also a sweep's cell)."""
    from randkv_jax.eval import harness, tasks

    preset = tasks.preset_for(dataset.name, dataset.problems[0].task)
    policy = _policy(policy_args, default_budget=preset.budget)
    base = tasks.sampling_for(model.config.architecture)
    sampling = tasks.Sampling(*(base_v if v is None else v for v, base_v in zip(sampling, dataclasses.astuple(base))))
    settings = harness.EvalSettings(
        policy=policy, samples=samples or preset.samples, max_new_tokens=max_new_tokens or preset.max_new_tokens,
        sampling=sampling, seed=seed, slots=slots, chunk=chunk, template_kwargs=template_kwargs, unsafe_code=unsafe,
        mesh=mesh,
    )
    print(f"eval: {dataset.name} ({len(dataset.problems)} problems x {settings.samples} samples), {policy}, "
          f"{sampling}, max {settings.max_new_tokens} new tokens -> {out}", flush=True)
    summary = harness.run_eval(model, harness.model_info(model, model_path), dataset, settings, out, progress=progress,
                               shard=shard)
    print(f"{summary.path}: {summary.skipped} samples were already done, {summary.completed} finished now "
          f"({summary.correct} strict-correct) in {summary.seconds:.0f} s; {summary.total} in the run")
    return summary


def _distributed(args: argparse.Namespace) -> tuple[int, int] | None:
    """Join a multi-process run (`jax.distributed.initialize`): this process's (index, count)."""
    import jax

    if args.coordinator is None and not args.distributed:
        return None
    if args.coordinator is not None:
        if args.num_processes is None or args.process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    else:  # the cluster's environment says who is who (Cloud TPU, SLURM, Open MPI, ...)
        jax.distributed.initialize()
    return jax.process_index(), jax.process_count()


def _eval(args: argparse.Namespace) -> None:
    from randkv_jax.eval.records import shard_path
    from randkv_jax.models.loading import load_model
    from randkv_jax.sharding import parse_mesh

    shard = _distributed(args)  # before anything touches a device
    out = args.out if shard is None else shard_path(args.out, *shard)
    dataset = _dataset(args.dataset, args.limit)  # validate before the (slow) model load
    mesh = parse_mesh(args.mesh)
    model = load_model(args.model, dtype=args.dtype, mesh=mesh)
    template_kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}
    _evaluate(model, args.model, dataset, args, samples=args.samples, max_new_tokens=args.max_new_tokens,
              seed=args.seed, slots=args.slots, chunk=args.chunk, sampling=(args.temperature, args.top_p, args.top_k),
              template_kwargs=template_kwargs, unsafe=args.unsafe_code_execution, out=out,
              progress=not args.no_progress, mesh=mesh, shard=shard)


def _report(args: argparse.Namespace) -> None:
    from randkv_jax.eval.report import report

    print(report(args.runs, out_dir=args.out_dir))


def _sweep(args: argparse.Namespace) -> None:
    from randkv_jax.eval.sweep import run_sweep
    from randkv_jax.models.loading import load_model

    models = {}

    def run_cell(cell, shared):
        key = (cell.model, shared.get("dtype"))
        if key not in models:
            models.clear()  # one model in memory at a time
            models[key] = load_model(None if cell.model == "default" else cell.model, dtype=key[1])
        policy_args = build_parser().parse_args(
            ["eval", "--dataset", cell.dataset, "--out", str(cell.out), "--policy", cell.policy]
            + ([] if cell.budget is None else ["--budget", str(cell.budget)])
            + [x for k, v in cell.options.items() for x in (f"--{k.replace('_', '-')}", str(v))])
        _evaluate(models[key], None if cell.model == "default" else cell.model,
                  _dataset(cell.dataset, shared.get("limit")), policy_args, samples=shared.get("samples"),
                  max_new_tokens=shared.get("max_new_tokens"), seed=shared.get("seed", 0),
                  slots=shared.get("slots", 8), chunk=64, sampling=(None, None, None), template_kwargs={},
                  unsafe=args.unsafe_code_execution, out=cell.out)

    for cell, outcome in run_sweep(args.config, run_cell, dry_run=args.dry_run):
        budget = "" if cell.budget is None else f" budget {cell.budget}"
        print(f"{outcome:8s} {cell.model} / {cell.dataset} / {cell.policy}{budget} -> {cell.out}")


def _plan(args: argparse.Namespace) -> None:
    import json

    from randkv_jax.models.config import read_hf_config
    from randkv_jax.plan import parse_bytes, plan
    from randkv_jax.sharding import mesh_sizes

    config = read_hf_config(args.model)
    policy = _policy(args)
    mesh = mesh_sizes(args.mesh) if args.mesh else None  # sizes only: the devices need not exist here
    memory = None if args.device_memory is None else parse_bytes(args.device_memory)
    result = plan(config, batch=args.batch, prompt=args.prompt, generate=args.generate, policy=policy, mesh=mesh,
                  dtype=args.dtype, chunk=args.chunk, device_memory=memory)
    if args.json:
        fields = dataclasses.asdict(result) | {"activations": result.activations, "total": result.total,
                                               "fits": result.fits}
        print(json.dumps(fields, indent=2))
    else:
        print(f"{args.model}: batch {args.batch}, prompt {args.prompt}, generate {args.generate}, {policy}, "
              f"{args.dtype}")
        print(result.table())
    if result.fits is False:
        raise ValueError(f"the plan needs {result.total / 2**30:.2f} GiB per device, more than the "
                         f"{memory / 2**30:.2f} GiB given: fewer rows per device, a smaller budget or a larger mesh")


def _bench(args: argparse.Namespace) -> None:
    from randkv_jax.eval import bench

    bench.main(args)


def _filler_texts(path: str) -> list[str]:
    """A JSONL file (each line's "solution", or "text", field) or a plain text file (paragraphs)."""
    import json

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"filler file {path} does not exist")
    raw = file.read_text()
    if file.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            text = record.get("solution") or record.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{path}, line {number}: no 'solution' or 'text' string")
            texts.append(text)
    else:
        texts = [p for p in raw.split("\n\n") if p.strip()]
    if not texts:
        raise ValueError(f"{path} holds no filler text")
    return texts


def _probe(args: argparse.Namespace) -> None:
    import json
    import time

    from randkv_jax import policies
    from randkv_jax.eval import probes
    from randkv_jax.models.loading import load_model

    texts = _filler_texts(args.filler)
    base = _policy(args)
    model = load_model(args.model, dtype=args.dtype)
    start, cpu = time.perf_counter(), time.process_time()
    common = dict(trials=args.trials, seed=args.seed, slots=args.slots)
    if args.kind == "planted-fact":
        counts = None if args.heads is None else [int(x) for x in args.heads.split(",")]
        result = probes.planted_fact(model, texts, base, rounds=args.rounds, head_counts=counts, **common)
    elif args.kind == "passcode":
        named = {}
        for name in args.policies.split(","):
            args.policy = name
            named[name] = policies.FullAttention() if name == "full" else _policy(args)
        result = probes.passcode(model, texts, named, rounds=args.rounds, **common)
    elif args.kind == "block-size":
        blocks = [int(x) for x in args.blocks.split(",")]
        result = probes.block_size(model, texts, base, blocks=blocks, tokens=args.tokens, **common)
    else:
        result = probes.survival(model, texts, base, tokens=args.tokens, **common)
    result["model"] = args.model or "default (SmolLM2-135M-Instruct)"
    result["wall_seconds"], result["cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu
    text = json.dumps(result, indent=2, default=float)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if args.plot:
        probes.plot(result, args.plot)


def _add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default=None,
                        help="devices of this process: 'data=D,model=M' (slots split D ways, KV heads and "
                             "parameters M ways) or 'auto' (data parallel over every local device)")


def _add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="random", help="eviction policy name (see randkv_jax.policies)")
    parser.add_argument("--budget", type=int, default=None,
                        help="T: entries each KV head holds right after a round, prompt and window included "
                             "(the paper's K, its engine's token_budget; default 1024, or the eval task's preset)")
    parser.add_argument("--selected", type=int, default=None,
                        help="the budget stated as its selected part: T = SELECTED + window "
                             "(the probes' 'K=1024 + W=64')")
    parser.add_argument("--buffer", type=int, default=None, help="sets --window and --interval both (default 64)")
    parser.add_argument("--window", type=int, default=None, help="w: newest entries never evicted")
    parser.add_argument("--interval", type=int, default=None,
                        help="i: generated tokens between rounds (default: window)")
    parser.add_argument("--protect", default=None,
                        help="prompt | sinks:N | none (default: the policy's published regime)")
    parser.add_argument("--preset", default=None, help="a policy's named preset (snapkv, rkv: paper | ...)")
    parser.add_argument("--stats", default=None,
                        help="TriAttention statistics (default: <model>/triattention_stats from `randkv calibrate`)")
    parser.add_argument("--convention", default=None, help=argparse.SUPPRESS)  # refused with the new equivalent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="randkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate with a bounded KV cache (default: Random Attention)")
    gen.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    _add_policy_arguments(gen)
    gen.add_argument("--max-new-tokens", type=int, default=512)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                     help="default: float32 on CPU, bfloat16 on GPU/TPU")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--enable-thinking", type=lambda v: v.lower() in ("1", "true", "yes"), default=None,
                     help="Qwen3 chat template switch (true/false)")
    gen.add_argument("--slots", type=int, default=None,
                     help="batch slots decoded together (default: one per prompt); more prompts than slots "
                          "queue, and a finished request's slot takes the next one")
    gen.add_argument("--chunk", type=int, default=64,
                     help="decode steps per device call (rounded up to a multiple of the policy's interval)")
    _add_mesh_argument(gen)
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

    ev = sub.add_parser("eval", help="evaluate on a benchmark: graded samples appended to a resumable JSONL run")
    ev.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    ev.add_argument("--dataset", required=True,
                    help="a registered name (math500, aime2025, aime2026, hmmt-feb-2025, gpqa-diamond, "
                         "livecodebench), a JSONL/CSV file, or NAME=FILE (a file under a name's presets)")
    _add_policy_arguments(ev)
    ev.add_argument("--samples", type=int, default=None, help="samples per problem (default: the task's preset)")
    ev.add_argument("--limit", type=int, default=None, help="the first N problems")
    ev.add_argument("--max-new-tokens", type=int, default=None, help="default: the preset's 32768")
    ev.add_argument("--out", required=True, help="the run file (JSONL); re-running the command resumes it")
    ev.add_argument("--seed", type=int, default=0, help="the run's seed (each sample's seed derives from it)")
    ev.add_argument("--temperature", type=float, default=None, help="default: the model's entry in the table")
    ev.add_argument("--top-p", type=float, default=None)
    ev.add_argument("--top-k", type=int, default=None)
    ev.add_argument("--slots", type=int, default=8, help="batch slots of the engine")
    ev.add_argument("--chunk", type=int, default=64, help="decode steps per device call")
    ev.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                     help="default: float32 on CPU, bfloat16 on GPU/TPU")
    ev.add_argument("--enable-thinking", type=lambda v: v.lower() in ("1", "true", "yes"), default=None,
                    help="Qwen3 chat template switch (true/false)")
    ev.add_argument("--unsafe-code-execution", action="store_true",
                    help="run LiveCodeBench programs with resource limits only where namespaces are unavailable")
    ev.add_argument("--no-progress", action="store_true")
    _add_mesh_argument(ev)
    ev.add_argument("--distributed", action="store_true",
                    help="one process of a multi-host run (jax.distributed.initialize from the cluster's "
                         "environment); each process evaluates its share of the problems into OUT.shard-I-of-N")
    ev.add_argument("--coordinator", default=None, help="host:port of process 0 (explicit multi-process setup)")
    ev.add_argument("--num-processes", type=int, default=None)
    ev.add_argument("--process-id", type=int, default=None)
    ev.set_defaults(run=_eval)

    rep = sub.add_parser("report", help="accuracy with intervals, pass@k, paired tests and plots of eval runs")
    rep.add_argument("runs", nargs="+", help="run files written by `randkv eval`")
    rep.add_argument("--out-dir", default=None, help="write report.md and PNG plots here")
    rep.set_defaults(run=_report)

    pl = sub.add_parser("plan", help="bytes per device of a generation run (parameters, KV buffer, loop state, "
                                     "activations), before anything is allocated")
    pl.add_argument("--model", required=True, help="a config.json or a checkpoint directory holding one")
    pl.add_argument("--batch", type=int, required=True, help="rows decoded together (all devices)")
    pl.add_argument("--prompt", type=int, required=True, help="prompt tokens per row")
    pl.add_argument("--generate", type=int, required=True, help="new tokens per row")
    _add_policy_arguments(pl)
    pl.add_argument("--mesh", default=None, help="'data=D,model=M' (the devices need not exist here)")
    pl.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    pl.add_argument("--chunk", type=int, default=64, help="decode steps per device call")
    pl.add_argument("--device-memory", default=None,
                    help="refuse a plan that does not fit this much memory per device (e.g. 80GiB, 141GB)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(run=_plan)

    pr = sub.add_parser("probe", help="the paper's mechanism probes: planted fact with head pinning, passcode, "
                                      "block size, survival curves")
    pr.add_argument("kind", choices=["planted-fact", "passcode", "block-size", "survival"])
    pr.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    pr.add_argument("--filler", required=True,
                    help="filler text: a JSONL file (its 'solution' or 'text' fields, e.g. MATH500) or a text file")
    _add_policy_arguments(pr)
    pr.add_argument("--policies", default="random,rkv,full", help="passcode: the policies compared (names)")
    pr.add_argument("--rounds", type=int, default=8, help="planted fact / passcode: the needle's age in rounds")
    pr.add_argument("--heads", default=None, help="planted fact: numbers of KV heads holding the needle "
                                                   "(comma list; default 0 .. all)")
    pr.add_argument("--blocks", default="1,4,16,64,256", help="block size: slots per draw (comma list)")
    pr.add_argument("--tokens", type=int, default=1024, help="block size / survival: forced tokens per trial")
    pr.add_argument("--trials", type=int, default=32)
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--slots", type=int, default=8)
    pr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    pr.add_argument("--out", default=None, help="write the result (JSON) here")
    pr.add_argument("--plot", default=None, help="write a PNG plot here")
    pr.set_defaults(run=_probe)

    be = sub.add_parser("bench", help="decode speed of every policy at one budget and of transformers, side by side "
                        "(JSON, markdown, PNG)")
    from randkv_jax.eval.bench import add_arguments as add_bench_arguments

    add_bench_arguments(be)
    be.set_defaults(run=_bench)

    sw = sub.add_parser("sweep", help="run a grid of evals from a TOML file, skipping finished runs")
    sw.add_argument("config", help="the sweep file (see randkv_jax.eval.sweep)")
    sw.add_argument("--dry-run", action="store_true", help="list the cells and what would run")
    sw.add_argument("--unsafe-code-execution", action="store_true")
    sw.set_defaults(run=_sweep)
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
