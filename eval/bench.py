"""`randkv bench`: decode speed of every policy at one budget, and of transformers, side by side.

    randkv bench --preset quick --json              # < 5 minutes on a 2-core CPU
    randkv bench --config qwen3-4b --dtype bfloat16 --prompt 1024 --gen 4096 --budget 2048 \\
        --policies full,random,triattention --no-hf --out bench-out     # an accelerator

One model (a checkpoint, the embedded SmolLM2-135M-Instruct, or random weights of any HF config:
`--config qwen3-4b` reads `../shared/configs/qwen3-4b.config.json`, or give a config.json path),
one batch of same-length prompts (random token ids, fixed seed), greedy, EOS ignored, so every
policy decodes exactly `gen` tokens per row. Arms, all in one process:

- decode: `randkv_jax.generate` itself (no benchmark-only path) under FullAttention,
  RandomAttention and the scoring policies, every eviction policy at the same budget T, window w
  and interval i (budget parity: every one holds T entries after a round). Per policy: decode
  tokens/s and ms/step (the median of `--repeats` runs after an untimed warm-up run that also
  compiles), ms per eviction round (the round alone, as the loop runs it: `decode._round` jitted,
  donated, on a due copy of the final state, median of 5) and its share of decode time, peak KV
  bytes held and allocated, compile + prefill seconds (the warm-up call's wall time less its
  decode time), and achieved bytes/s: (parameter bytes + the mean KV bytes attention reads per
  step) / step time, as a fraction of the machine's read bandwidth (`read_bandwidth`, probed
  before the timed runs and after each interleaving round; the highest probe counts);
- eviction overhead: FullAttention in Random's buffer shape holding Random's mean entries per
  step (`mean_fill`), against Random's step time (rounds amortised); its short runs repeat to
  span as many steps as Random's;
- transformers (when installed and `--hf`): `generate` on the same weights (`eval/hf_baseline`),
  sdpa, the same thread count, dynamic and static caches, the better one counted, decode timed
  inside each call by per-token timestamps; `--hf-gen` tokens (default `--gen`), its greedy
  tokens compared with FullAttention's at that length (`jax_vs_hf`). When `--hf-gen` < `--gen`,
  `random_vs_hf` divides by transformers' rate over a whole `--gen` run, timed on `--hf-steps`
  of its steps (`hf_at_gen_arm`: a static cache of prompt + gen slots; a dynamic one at the
  run's mean length);
- equal memory (`--memory-bytes`, default: FullAttention's KV buffer at `--batch`): the largest
  batch each policy's buffer fits (capped at `--max-batch`), its throughput and its share of
  the read bandwidth there;
- serving (`--requests`): an `Engine` with `--batch` slots serving that many requests with
  long-tailed lengths (`bench_engine.workload`), useful tokens/s per policy.

Output: one JSON object (stdout with `--json`; always `bench.json` under `--out`), a markdown
table (`bench.md`) and a PNG chart (`bench.png`). The headline ratios: `random_vs_full`,
`random_vs_triattention`, `random_vs_best_scorer` (Random / the fastest scoring policy),
`random_vs_full_bytes_bound` (FullAttention's bytes read per step / Random's: what `random_vs_full`
reaches when both steps are bound by their reads),
`eviction_overhead` (Random step / Full step at the same entries), `jax_vs_hf` (FullAttention /
transformers, full caches both) and `random_vs_hf` (Random / transformers at `--gen`). Wall-clock
numbers are measurements, never test assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from randkv_jax.eval.bench_engine import workload
from randkv_jax.models.config import read_hf_config
from randkv_jax.models.loading import load_model
from randkv_jax.models.model import Model, init_params, resolve_dtype

from randkv_jax import decode, policies
from randkv_jax.engine import Engine
from randkv_jax.generate import generate
from randkv_jax.sampling import SamplingParams

SCORERS = ("snapkv", "rkv", "vase", "triattention")
CONFIG_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "configs"
PRESETS: dict[str, dict[str, Any]] = {
    # a smoke-sized run of the decode, transformers and equal-memory arms (no serving arm):
    # `randkv bench --preset quick --json`, < 5 min on a 2-core CPU
    "quick": dict(batch=4, prompt=16, gen=64, budget=48, window=16, interval=16, repeats=3, hf_gen=16, memory_gen=48,
                  requests=0, arm_policies=("full", "random")),
    # the target shape (prompt 256, 4096 generated, budget 512, batch 8)
    "targets": dict(batch=8, prompt=256, gen=4096, budget=512, repeats=3, hf_gen=1024, memory_gen=512, requests=16,
                    serving_max_len=2048),
}
DEFAULTS = dict(batch=8, prompt=128, gen=1024, budget=512, window=64, interval=64, repeats=3, hf_gen=None, hf_steps=32,
                memory_gen=None, requests=0, serving_max_len=1024, arm_policies=("full", "random", "triattention"))


# ---------------------------------------------------------------------------------------- machine

def read_bandwidth(gib: float = 1.0, repeats: int = 5, threads: int | None = None) -> float:
    """The machine's memory read bandwidth in bytes/s: the best of `repeats` multi-threaded sums
    over `gib` GiB of float32 (every byte read once per pass, one chunk per thread at a time)."""
    threads = threads or os.cpu_count() or 1
    data = np.ones(int(gib * (1 << 30)) // 4, np.float32)
    parts = np.array_split(data, 4 * threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


# ------------------------------------------------------------------------------------------ model

def bench_model(model: str | None, config: str | None, dtype: str | None, seed: int = 0) -> tuple[Model, str]:
    """The model to time and a name for it: random weights of `config` (a name under
    ../shared/configs or a config.json path), else the checkpoint `model` (None: embedded)."""
    if config is None:
        loaded = load_model(model, dtype=dtype)
        return loaded, model or "SmolLM2-135M-Instruct (embedded)"
    path = Path(config)
    if not path.is_file():
        path = CONFIG_DIR / f"{config}.config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config {config!r}: not a file, and no {path}")
    cfg = read_hf_config(path)
    jdtype = resolve_dtype(dtype)
    params = jax.jit(functools.partial(init_params, cfg, dtype=jdtype))(jax.random.key(seed))
    return Model(cfg, params, dtype=jdtype), f"{path.name} (random weights)"


def weight_bytes_per_step(model: Model) -> int:
    """Parameter bytes a decode step reads: all of them, except that the embedding lookup of an
    untied model reads only a row per token (its lm_head is read whole)."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    if not model.config.tie_word_embeddings:
        total -= model.params["embed"]["embedding"].nbytes
    return total


def slot_bytes(model: Model) -> int:
    """Bytes of one KV slot across layers and KV heads (keys and values)."""
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * jnp.dtype(model.dtype).itemsize


def mean_fill(policy, prompt: int, gen: int) -> float:
    """Mean entries attention reads per decode step of one row (after each step's append), as
    the loop runs them: the first token comes from prefill, each step appends one, and a round
    after a step leaves T when the row is due (`rule.due`)."""
    fills, fill, generated = [], prompt, 0
    for _ in range(gen - 1):
        fill, generated = fill + 1, generated + 1
        fills.append(fill)
        if isinstance(policy, policies.EvictionPolicy) and policy.rule.due(np.array([fill]), np.array([generated]))[0]:
            fill = policy.budget
    return float(np.mean(fills)) if fills else float(prompt)


def triattention_stats(model: Model, out_dir: Path) -> Path:
    """TriAttention statistics from 512 random token ids: its scoring costs the same whatever
    the statistics hold, so a benchmark needs no calibration text (pass `--stats` for real ones)."""
    from randkv_jax.calibration import calibrate

    return calibrate(model, prompts_of(model, 1, 512, seed=4)[0], out_dir, text_file="random ids")


def prompts_of(model: Model, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, model.config.vocab_size, size=length).tolist() for _ in range(batch)]


# -------------------------------------------------------------------------------------- decoding

@dataclasses.dataclass
class PolicyRun:
    """One policy's decode arm (times are medians over the repeats)."""

    policy: str
    tokens_per_second: float
    ms_per_step: float
    steps: int
    rounds: int
    ms_per_round: float
    round_share: float  # rounds x ms_per_round / decode time
    kv_bytes_held: int  # peak bytes held, all rows
    kv_bytes_allocated: int  # the buffer's bytes, all rows
    mean_fill: float
    bytes_per_step: float  # parameter bytes + the mean KV bytes attention reads per step, all rows
    achieved_bytes_per_second: float
    bandwidth_fraction: float
    compile_seconds: float
    repeats: list[float]  # tokens/s of each timed run
    tokens: list[list[int]] = dataclasses.field(repr=False, default_factory=list)


def _median_of(runs, key):
    return statistics.median(key(r) for r in runs)


def time_round(model: Model, policy, state: decode.LoopState, repeats: int = 5) -> float:
    """Median ms of one eviction round alone (every row due), at the loop's shapes: the keep mask
    and compaction (`decode._round`, in place) on a copy of `state` advanced by one interval."""
    if not isinstance(policy, policies.EvictionPolicy):
        return 0.0
    spec = decode.DecodeSpec(config=model.config, dtype=model.dtype, policy=policy, sampling=SamplingParams(),
                             chunk=policy.interval, platform=decode.platform_of(model.params))
    buffer = state.buffer
    advance = policy.interval - buffer.generated % policy.interval  # [b] steps to each row's next round
    per_row = lambda x: x[:, None, None]  # noqa: E731
    slots = jnp.arange(buffer.capacity)
    fresh = (slots >= per_row(buffer.fill)) & (slots < per_row(buffer.fill + advance))  # [b, k, s]
    new_pos = per_row(buffer.prompt_lens + buffer.generated - buffer.fill) + slots
    positions = jnp.where(fresh[None], new_pos[None], buffer.positions)
    due = dataclasses.replace(buffer, positions=positions, fill=buffer.fill + advance,
                              generated=buffer.generated + advance)
    if int(jnp.max(due.fill)) > buffer.capacity:
        return 0.0  # no round fits after the last step at these lengths (none ran either)
    if not bool(jnp.all(policy.due(due))):
        raise RuntimeError("the synthetic round state is not due; the benchmark's shapes are inconsistent")
    # the loop's own round (`decode._round`), its state donated as in the loop: the compaction
    # then writes back into the buffer it reads, as it does there
    run_round = jax.jit(lambda s: decode._round(s, spec), donate_argnums=0)
    due_state = dataclasses.replace(state, buffer=due)
    times = []
    for _ in range(repeats + 1):  # the first call compiles
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, due_state))
        start = time.perf_counter()
        jax.block_until_ready(run_round(fresh))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


@dataclasses.dataclass(frozen=True)
class Arm:
    """One timed configuration: a policy on a batch of prompts, `gen` tokens per row."""

    name: str
    policy: Any
    prompts: list[list[int]]
    gen: int
    capacity: int
    runs_per_repeat: int = 1
    """Timed runs per interleaving round: a short arm (the eviction-overhead reference) runs
    several, so that its median is over as many steps' worth of noise as the long arms'."""

    def run(self, model: Model, gen: int | None = None, **kwargs):
        return generate(model, self.prompts, policy=self.policy, max_new_tokens=gen or self.gen, ignore_eos=True,
                        chat=False, capacity=self.capacity, **kwargs)


def arm(name: str, policy, prompts: list[list[int]], gen: int, capacity: int | None = None) -> Arm:
    return Arm(name, policy, prompts, gen, capacity or decode.padded_capacity(policy, len(prompts[0]), gen))


def interleaved(arms: list[Arm], repeats: int) -> Iterator[tuple[Arm, bool]]:
    """The timed runs' order, (arm, is its first run): `repeats` rounds over the arms, each arm's
    `runs_per_repeat` runs in a row, the arm order reversed every other round (1, 2, 3, 3, 2, 1,
    ...) so that a steady drift of the machine's speed falls on every arm alike."""
    for r in range(repeats):
        for a in arms if r % 2 == 0 else arms[::-1]:
            for k in range(a.runs_per_repeat):
                yield a, r == k == 0


def measure(model: Model, arms: list[Arm], repeats: int, probe: Callable[[], float] = read_bandwidth,
            time_rounds: bool = True) -> tuple[dict[str, PolicyRun], list[float]]:
    """Every arm warmed up (compiled, with a round run), then `repeats` timed runs of each,
    interleaved (arm 1, arm 2, ..., arm 1, ...) so that a slow spell of the machine falls on all
    arms alike. The warm-up is 2i + 1 steps in the timed buffer shape: the same program.

    The read bandwidth is probed (`probe()`, bytes/s) before the timed runs and after each
    interleaving round; achieved bytes/s are a fraction of the highest probe, the best the
    machine showed while the arms ran. Returns the runs and the probes, in order."""
    compile_seconds = {}
    for a in arms:
        start = time.perf_counter()
        warm = a.run(model, gen=min(a.gen, 2 * getattr(a.policy, "interval", 32) + 1))
        compile_seconds[a.name] = time.perf_counter() - start - warm.decode_seconds
    runs: dict[str, list] = {a.name: [] for a in arms}
    probes = [probe()]
    per_round = sum(a.runs_per_repeat for a in arms)
    for i, (a, first) in enumerate(interleaved(arms, repeats)):
        runs[a.name].append(a.run(model, return_state=first))
        if (i + 1) % per_round == 0:
            probes.append(probe())
    bandwidth = max(probes)
    out = {}
    for a in arms:
        first, timed = runs[a.name][0], runs[a.name]
        if any(t.tokens != first.tokens for t in timed):
            raise RuntimeError(f"{a.name}: the repeats produced different tokens (same seeds)")
        batch, prompt = len(a.prompts), len(a.prompts[0])
        ms_step = _median_of(timed, lambda r: r.decode_seconds / max(r.decode_steps, 1)) * 1e3
        rounds = int(first.state.rounds_run)
        ms_round = time_round(model, a.policy, first.state) if (time_rounds and rounds) else 0.0
        fill = mean_fill(a.policy, prompt, a.gen)
        step_bytes = weight_bytes_per_step(model) + fill * slot_bytes(model) * batch
        achieved = step_bytes / (ms_step / 1e3)
        decode_ms = _median_of(timed, lambda r: r.decode_seconds) * 1e3
        out[a.name] = PolicyRun(
            policy=a.name, tokens_per_second=_median_of(timed, lambda r: r.decode_tokens_per_second),
            ms_per_step=ms_step, steps=first.decode_steps, rounds=rounds, ms_per_round=ms_round,
            round_share=rounds * ms_round / decode_ms if decode_ms else 0.0,
            kv_bytes_held=sum(st.kv_bytes for st in first.stats),
            kv_bytes_allocated=a.capacity * slot_bytes(model) * batch, mean_fill=fill, bytes_per_step=step_bytes,
            achieved_bytes_per_second=achieved, bandwidth_fraction=achieved / bandwidth,
            compile_seconds=compile_seconds[a.name], repeats=[t.decode_tokens_per_second for t in timed],
            tokens=first.tokens,
        )
    return out, probes


def full_at_fill(model: Model, fill: float, interval: int, batch: int, capacity: int, steps_to_match: int
                 ) -> Arm:
    """FullAttention holding `fill` entries per step on average, in a buffer of `capacity` slots:
    prompt fill - i, then 2i decode steps (the eviction-overhead reference). One such run is
    short, so it runs enough times per interleaving round (at least 5) to span `steps_to_match`
    decode steps, the compared arm's: both then sample the machine's speed over as long a time."""
    prompt = max(1, round(fill) - interval)
    reference = arm("full_at_random_fill", policies.FullAttention(), prompts_of(model, batch, prompt, seed=1),
                    2 * interval + 1, capacity)
    return dataclasses.replace(reference, runs_per_repeat=max(5, -(-steps_to_match // (2 * interval))))


# ----------------------------------------------------------------------------------- other arms

def hf_arm(hf_model, prompts: list[list[int]], gen: int, repeats: int, full_tokens: list[list[int]]) -> dict:
    """transformers `generate` (sdpa, dynamic and static caches) on the same weights and lengths,
    decode timed by its per-token timestamps; its greedy tokens compared with FullAttention's."""
    from randkv_jax.eval import hf_baseline

    out: dict[str, Any] = {"threads": hf_baseline.set_threads(), "gen": gen}
    for cache in hf_baseline.CACHES:
        rate, tokens = hf_baseline.hf_decode_tokens_per_second(hf_model, prompts, gen, cache=cache, repeats=repeats)
        out[f"{cache}_tokens_per_second"] = rate
        out.setdefault("tokens", tokens)
    out["tokens_per_second"] = max(out["dynamic_tokens_per_second"], out["static_tokens_per_second"])
    tokens = out.pop("tokens")
    agree = [_common_prefix(a, b[:gen]) for a, b in zip(tokens, full_tokens)]
    out["tokens_equal_full"] = all(n == gen for n in agree)
    out["equal_prefix"] = min(agree)  # leading tokens equal to FullAttention's, worst row
    return out


def hf_at_gen_arm(hf_model, model: Model, batch: int, prompt: int, gen: int, steps: int, repeats: int) -> dict:
    """transformers' decode rate over a whole `gen`-token run, timed on `steps` of its steps.

    Static cache: `prompt + gen` slots, every step attending over all of them (a step costs the
    same at any fill), so `steps` steps after the prompt time the whole run. Dynamic cache: a
    step reads and appends to its current length, so the steps are timed around the run's mean
    length, from a prompt of `prompt + gen // 2 - steps // 2` random ids. Both after the model is
    warm (the `hf_arm` ran first); the better cache counts, as there.
    """
    from randkv_jax.eval import hf_baseline

    static, _ = hf_baseline.hf_decode_tokens_per_second(
        hf_model, prompts_of(model, batch, prompt), steps, cache="static", cache_len=prompt + gen, repeats=repeats,
        warmup=False)
    mid = prompt + gen // 2 - steps // 2
    dynamic, _ = hf_baseline.hf_decode_tokens_per_second(
        hf_model, prompts_of(model, batch, mid, seed=2), steps, cache="dynamic", repeats=repeats, warmup=False)
    return {"gen": gen, "steps": steps, "static_tokens_per_second": static, "dynamic_tokens_per_second": dynamic,
            "dynamic_prompt": mid, "tokens_per_second": max(static, dynamic)}


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def equal_memory_arm(model: Model, names: list[str], make, prompt: int, gen: int, memory_bytes: int,
                     max_batch: int, repeats: int) -> list[dict]:
    """The largest batch each policy's buffer fits in `memory_bytes` of KV, and its tokens/s and
    share of the read bandwidth there (probed in this arm's own interleaving rounds)."""
    out, arms = [], []
    for name in names:
        policy = make(name)
        capacity = decode.padded_capacity(policy, prompt, gen)
        batch = min(max_batch, memory_bytes // (capacity * slot_bytes(model)))
        if batch < 1:
            out.append(dict(policy=name, batch=0, capacity=capacity, tokens_per_second=0.0))
            continue
        arms.append(arm(name, policy, prompts_of(model, batch, prompt, seed=2), gen, capacity))
    runs, _ = measure(model, arms, repeats, time_rounds=False)
    for a in arms:
        out.append(dict(policy=a.name, batch=len(a.prompts), capacity=a.capacity,
                        tokens_per_second=runs[a.name].tokens_per_second,
                        kv_bytes_allocated=runs[a.name].kv_bytes_allocated,
                        bandwidth_fraction=runs[a.name].bandwidth_fraction))
    return out


def serving_arm(model: Model, names: list[str], make, slots: int, prompt: int, requests: int, max_len: int) -> list[dict]:
    """An `Engine` with `slots` slots serving `requests` requests of long-tailed lengths."""
    lengths = workload(requests, 32, max_len)
    prompts = prompts_of(model, requests, prompt, seed=3)
    def serve(policy):
        engine = Engine(model, policy=policy, slots=slots, capacity=decode.padded_capacity(policy, prompt, max_len),
                        max_prompt_tokens=prompt, max_new_tokens=max_len)
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            engine.submit(p, max_new_tokens=n, seed=i, ignore_eos=True, chat=False)
        start = time.perf_counter()
        done = list(engine.run())
        return time.perf_counter() - start, sum(len(c.tokens) for c in done)

    out = []
    for name in names:
        serve(make(name))  # compile
        seconds, useful = serve(make(name))
        out.append(dict(policy=name, requests=requests, slots=slots, seconds=seconds, useful_tokens=useful,
                        tokens_per_second=useful / seconds))
    return out


# ------------------------------------------------------------------------------------------ main

def check_settings(settings: dict[str, Any]) -> None:
    """Refuse, before anything is timed, settings that no arm could measure: a ValueError naming them."""
    low = {name: settings[name] for name in ("batch", "prompt", "gen", "budget", "window", "interval")
           if settings[name] < 1}
    if settings["repeats"] < 3:
        low["repeats"] = settings["repeats"]  # every figure is the median of at least 3 runs
    if settings["hf_steps"] < 2:
        low["hf_steps"] = settings["hf_steps"]  # a decode step is timed between two tokens
    if settings["hf_gen"] is not None and settings["hf_gen"] < 2:
        low["hf_gen"] = settings["hf_gen"]
    if low:
        raise ValueError("bench settings too small (at least 1; repeats 3; hf_steps and hf_gen 2): "
                         + ", ".join(f"{k}={v}" for k, v in low.items()))


def run(args: argparse.Namespace) -> dict:
    settings = {**DEFAULTS, **PRESETS.get(args.preset or "", {})}
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    check_settings(settings)
    b, p, g, t = settings["batch"], settings["prompt"], settings["gen"], settings["budget"]
    window, interval = settings["window"], settings["interval"]
    names = args.policies.split(",") if args.policies else ["full", "random", *SCORERS]

    stats: list = []  # TriAttention's statistics, computed once when first needed

    def make(name):
        if name == "full":
            return policies.FullAttention()
        extra = {}
        if name == "triattention":
            if not stats:
                stats.append(args.stats or triattention_stats(model, Path(tempfile.mkdtemp(prefix="randkv-bench-"))))
            extra = dict(stats=stats[0])
        return policies.get(name, budget=t, window=window, interval=interval, **extra)

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not args.quiet else (lambda *a: None)  # noqa: E731
    model, model_name = bench_model(args.model, args.config, args.dtype)
    log(f"{model_name}, {jnp.dtype(model.dtype).name}, "
        f"batch {b}, prompt {p}, gen {g}, T={t} w={window} i={interval}")
    prompts = prompts_of(model, b, p)
    hf_gen = settings["hf_gen"] or g
    want_hf = args.hf and _has_transformers()
    arms = [arm(name, make(name), prompts, g) for name in names]
    if "random" in names:  # the eviction-overhead reference: Full in Random's shape, at its mean entries
        rnd = arms[names.index("random")]
        arms.append(full_at_fill(model, mean_fill(rnd.policy, p, g), interval, b, rnd.capacity, g - 1))
    if want_hf and (hf_gen != g or "full" not in names):  # FullAttention at transformers' length
        arms.append(arm("full_at_hf_gen", make("full"), prompts, hf_gen))
    runs, probes = measure(model, arms, settings["repeats"])
    log("read bandwidth probes " + ", ".join(f"{x / 1e9:.1f}" for x in probes) + " GB/s (the highest counts)")
    for r in runs.values():
        log(f"  {r.policy:20s} {r.tokens_per_second:8.1f} tok/s  {r.ms_per_step:7.2f} ms/step  "
            f"round {r.ms_per_round:6.2f} ms ({100 * r.round_share:.1f}%)  {100 * r.bandwidth_fraction:.0f}% of bw")
    extra = {n: runs.pop(n) for n in ("full_at_random_fill", "full_at_hf_gen") if n in runs}
    asdict = lambda r: {k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"}  # noqa: E731
    result: dict[str, Any] = dict(
        model=model_name, dtype=jnp.dtype(model.dtype).name, backend=jax.default_backend(),
        device=jax.devices()[0].device_kind, jax_version=jax.__version__, cpu_count=os.cpu_count(),
        batch=b, prompt=p, gen=g, budget=t, window=window, interval=interval, repeats=settings["repeats"],
        read_bandwidth=max(probes), read_bandwidth_probes=probes,
        weight_bytes_per_step=weight_bytes_per_step(model),
        policies={n: asdict(r) for n, r in runs.items()}, references={n: asdict(r) for n, r in extra.items()},
    )
    rate = lambda n: runs[n].tokens_per_second  # noqa: E731
    scorers = [n for n in runs if n in SCORERS]
    if "random" in runs:
        result["random_vs_full"] = rate("random") / rate("full") if "full" in runs else None
        # what random_vs_full can reach when both steps are bound by the bytes they read
        result["random_vs_full_bytes_bound"] = (runs["full"].bytes_per_step / runs["random"].bytes_per_step
                                                if "full" in runs else None)
        result["random_vs_triattention"] = rate("random") / rate("triattention") if "triattention" in runs else None
        result["random_vs_best_scorer"] = rate("random") / max(rate(n) for n in scorers) if scorers else None
        result["eviction_overhead"] = runs["random"].ms_per_step / extra["full_at_random_fill"].ms_per_step
    if want_hf:
        from randkv_jax.eval import hf_baseline

        full = extra.get("full_at_hf_gen") or runs["full"]
        hf_model = hf_baseline.to_transformers(model)
        hf = hf_arm(hf_model, prompts, hf_gen, settings["repeats"], full.tokens)
        hf["jax_full_tokens_per_second"] = full.tokens_per_second
        result["hf"] = hf
        result["jax_vs_hf"] = full.tokens_per_second / hf["tokens_per_second"]
        log(f"  transformers {hf['tokens_per_second']:.1f} tok/s (gen {hf_gen}); jax full "
            f"{full.tokens_per_second:.1f}; tokens equal: {hf['tokens_equal_full']} "
            f"({hf['equal_prefix']} of {hf_gen} leading tokens, worst row)")
        if "random" in runs and hf_gen == g:
            result["random_vs_hf"] = rate("random") / hf["tokens_per_second"]
        elif "random" in runs:
            at_gen = result["hf_at_gen"] = hf_at_gen_arm(hf_model, model, b, p, g, min(settings["hf_steps"], g),
                                                         settings["repeats"])
            result["random_vs_hf"] = rate("random") / at_gen["tokens_per_second"]
            log(f"  transformers at {g} generated (timed on {at_gen['steps']} steps): static "
                f"{at_gen['static_tokens_per_second']:.1f}, dynamic {at_gen['dynamic_tokens_per_second']:.1f} tok/s")
    elif args.hf:
        log("  no transformers arm (transformers not installed)")
    if not args.no_memory:
        memory = args.memory_bytes or runs.get("full", next(iter(runs.values()))).kv_bytes_allocated
        gen_m = settings["memory_gen"] or g
        memory_names = [n for n in settings["arm_policies"] if n in names]
        result["equal_memory"] = dict(memory_bytes=memory, gen=gen_m, runs=equal_memory_arm(
            model, memory_names, make, p, gen_m, memory, args.max_batch, settings["repeats"]))
        log(f"  equal memory ({memory / 2**20:.0f} MiB): " + ", ".join(
            f"{r['policy']} batch {r['batch']} {r['tokens_per_second']:.1f} tok/s" for r in result["equal_memory"]["runs"]))
    if settings["requests"]:
        serve_names = [n for n in settings["arm_policies"] if n in names]
        result["serving"] = serving_arm(model, serve_names, make, b, p, settings["requests"], settings["serving_max_len"])
        log("  serving: " + ", ".join(f"{r['policy']} {r['tokens_per_second']:.1f} tok/s" for r in result["serving"]))
    return result


def markdown(result: dict) -> str:
    """The result as a markdown table (one row per policy) and the headline ratios."""
    lines = [
        f"{result['model']}, {result['dtype']}, {result['backend']} ({result['device']}, {result['cpu_count']} CPUs), "
        f"jax {result['jax_version']}; batch {result['batch']}, prompt {result['prompt']}, {result['gen']} generated, "
        f"T={result['budget']} w={result['window']} i={result['interval']}; medians of {result['repeats']} runs; "
        f"read bandwidth {result['read_bandwidth'] / 1e9:.1f} GB/s (the highest of "
        f"{len(result['read_bandwidth_probes'])} probes, lowest {min(result['read_bandwidth_probes']) / 1e9:.1f}).",
        "",
        "| policy | tok/s | ms/step | rounds | ms/round | round share | mean entries | KV held MiB | "
        "KV alloc MiB | GB/s | of bw | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["policies"].values():
        lines.append(
            f"| {r['policy']} | {r['tokens_per_second']:.1f} | {r['ms_per_step']:.2f} | {r['rounds']} | "
            f"{r['ms_per_round']:.2f} | {100 * r['round_share']:.1f}% | {r['mean_fill']:.0f} | "
            f"{r['kv_bytes_held'] / 2**20:.1f} | {r['kv_bytes_allocated'] / 2**20:.1f} | "
            f"{r['achieved_bytes_per_second'] / 1e9:.1f} | {100 * r['bandwidth_fraction']:.0f}% | "
            f"{r['compile_seconds']:.1f} |")
    lines.append("")
    for key in ("random_vs_full", "random_vs_full_bytes_bound", "random_vs_triattention", "random_vs_best_scorer",
                "eviction_overhead", "jax_vs_hf", "random_vs_hf"):
        if result.get(key) is not None:
            lines.append(f"- `{key}`: {result[key]:.2f}")
    if "hf" in result:
        hf = result["hf"]
        lines.append(f"- transformers ({hf['threads']} threads, gen {hf['gen']}): dynamic "
                     f"{hf['dynamic_tokens_per_second']:.1f}, static {hf['static_tokens_per_second']:.1f} tok/s; "
                     f"greedy tokens equal to FullAttention's: {hf['tokens_equal_full']} "
                     f"({hf['equal_prefix']} of {hf['gen']} leading tokens, worst row)")
    if "hf_at_gen" in result:
        at = result["hf_at_gen"]
        lines.append(f"- transformers at {at['gen']} generated, {at['steps']} steps timed at that run's cache: "
                     f"static {at['static_tokens_per_second']:.1f} (prompt + {at['gen']} slots), dynamic "
                     f"{at['dynamic_tokens_per_second']:.1f} tok/s (at the mean length, prompt {at['dynamic_prompt']})")
    if "equal_memory" in result:
        em = result["equal_memory"]
        lines.append(f"- equal memory ({em['memory_bytes'] / 2**20:.0f} MiB of KV, gen {em['gen']}): " + ", ".join(
            f"{r['policy']} batch {r['batch']} -> {r['tokens_per_second']:.1f} tok/s"
            + (f" ({r['bandwidth_fraction']:.0%} of bw)" if r["batch"] else "") for r in em["runs"]))
    if "serving" in result:
        lines.append("- serving (engine, " + f"{result['serving'][0]['requests']} requests, "
                     f"{result['serving'][0]['slots']} slots): " + ", ".join(
                         f"{r['policy']} {r['tokens_per_second']:.1f} useful tok/s" for r in result["serving"]))
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> None:
    """Bar chart of decode tokens/s per policy (transformers too when measured)."""
    from randkv_jax.eval.report import figure

    names = list(result["policies"])
    rates = [result["policies"][n]["tokens_per_second"] for n in names]
    at_gen = result.get("hf_at_gen") or (result["hf"] if "hf" in result and result["hf"]["gen"] == result["gen"]
                                          else None)
    if at_gen:
        names.append("transformers")
        rates.append(at_gen["tokens_per_second"])
    fig = figure()
    ax = fig.add_subplot()
    ax.bar(names, rates, color=["#d62728" if n == "random" else "#7f7f7f" for n in names])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"batch {result['batch']}, prompt {result['prompt']}, {result['gen']} generated, "
                 f"T={result['budget']}", fontsize=9)
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named shape (flags given explicitly override it)")
    parser.add_argument("--model", help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--config", help="random weights of this HF config: a name under ../shared/configs "
                        "(e.g. qwen3-4b) or a config.json path")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on GPU/TPU")
    for name in ("batch", "prompt", "gen", "budget", "repeats"):
        parser.add_argument(f"--{name}", type=int, help=f"default {DEFAULTS[name]} (or the preset's)")
    parser.add_argument("--hf-gen", type=int, help="generated tokens of the transformers arm (default: --gen)")
    parser.add_argument("--hf-steps", type=int, help="when --hf-gen < --gen: transformers' decode steps timed at "
                        f"--gen's cache for random_vs_hf (default {DEFAULTS['hf_steps']})")
    parser.add_argument("--memory-gen", type=int, help="generated tokens of the equal-memory arm (default: --gen)")
    parser.add_argument("--requests", type=int, help="serving arm: requests through the engine (0: no serving arm)")
    parser.add_argument("--serving-max-len", type=int, help="serving arm: longest generation")
    parser.add_argument("--window", type=int, help="w (default 64, or the preset's)")
    parser.add_argument("--interval", type=int, help="i (default 64, or the preset's)")
    parser.add_argument("--stats", help="TriAttention statistics directory (default: calibrated on random ids)")
    parser.add_argument("--policies", help=f"comma-separated (default: full,random,{','.join(SCORERS)})")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    parser.add_argument("--no-memory", action="store_true", help="skip the equal-memory arm")
    parser.add_argument("--memory-bytes", type=int, help="equal-memory KV budget (default: FullAttention's buffer)")
    parser.add_argument("--max-batch", type=int, default=64, help="equal-memory arm: largest batch tried")
    parser.add_argument("--out", help="directory for bench.json, bench.md, bench.png")
    parser.add_argument("--json", action="store_true", help="print the JSON object on stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def main(args: argparse.Namespace) -> dict:
    result = run(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "bench.md").write_text(markdown(result))
        chart(result, out / "bench.png")
    print(json.dumps(result) if args.json else markdown(result))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    main(p.parse_args())
