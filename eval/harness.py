"""`randkv eval`: a dataset through the continuous-batching engine, graded, one JSON line per sample.

    summary = run_eval(model, model_info, dataset, settings, out="run.jsonl")

Every (problem, sample) gets a seed derived from the run's seed, the problem id and the sample
index only, and the engine makes a request's tokens independent of what runs beside it, so a run
is reproducible piece by piece: re-running the same command after a kill continues where it
stopped (`records.RunWriter` drops a torn last line; finished pairs are skipped, never redone)
and the file ends with exactly the records of an uninterrupted run (timings aside). A changed
configuration (model, tokenizer, dataset file, policy, sampling, engine shape, grader, package
versions: everything in `build_config`, hashed) is refused rather than mixed in.

Math and GPQA answers are graded as they complete (`grading`); LiveCodeBench programs are judged
in a sandbox (`code_tests`, a thread pool so decoding goes on), and refused up front where the
sandbox's isolation is unavailable unless `unsafe_code` is set.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import platform as host_platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from randkv_jax.engine import Engine, bucket, encode_prompt
from randkv_jax.eval import code_tests, grading, sandbox, tasks
from randkv_jax.eval.datasets import Dataset, Problem
from randkv_jax.eval.records import RunWriter
from randkv_jax.models.model import Model

VERSIONED = ("randkv-jax", "jax", "jaxlib", "flax", "numpy", "tokenizers", "math-verify", "latex2sympy2_extended")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What a run does besides the model and the dataset."""

    policy: Any
    samples: int
    max_new_tokens: int
    sampling: tasks.Sampling
    seed: int = 0
    slots: int = 8
    chunk: int = 64
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    unsafe_code: bool = False
    mesh: Any = None
    """A `jax.sharding.Mesh` of this process's devices (`randkv_jax.sharding.parse_mesh`): slots
    split over `data`, KV heads over `model`. None: one device."""


@dataclasses.dataclass(frozen=True)
class RunSummary:
    path: Path
    total: int  # (problem, sample) pairs in the run
    skipped: int  # already in the file when this session started
    completed: int  # finished in this session
    correct: int  # strict-correct among those
    seconds: float


def params_fingerprint(params: Any) -> str:
    """A content hash of the parameters: per leaf, a weighted sum of its raw bits modulo 2^32
    (integer arithmetic: the same on every backend and sharding), then sha256 over the leaves."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        bits = jax.lax.bitcast_convert_type(leaf, {2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize])
        flat = bits.reshape(-1).astype(jnp.uint32)
        weights = (jnp.arange(flat.size, dtype=jnp.uint32) % jnp.uint32(65521)) + jnp.uint32(1)
        checksum = int(jnp.sum(flat * weights, dtype=jnp.uint32))
        digest.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}:{checksum}".encode())
    return digest.hexdigest()


def tokenizer_fingerprint(model: Model) -> str | None:
    if model.tokenizer is None:
        return None
    t = model.tokenizer
    return hashlib.sha256((t.backend.to_str() + "\0" + (t.chat_template or "")).encode()).hexdigest()


def model_info(model: Model, path: str | None) -> dict:
    """The model part of a run's configuration: where it came from and what it is."""
    from randkv_jax.calibration import config_fingerprint

    return {
        "path": path or "embedded SmolLM2-135M-Instruct", "architecture": model.config.architecture,
        "config_sha256": config_fingerprint(model.config), "dtype": jnp.dtype(model.dtype).name,
        "params_fingerprint": params_fingerprint(model.params), "tokenizer_sha256": tokenizer_fingerprint(model),
    }


def versions() -> dict:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = host_platform.python_version()
    return out


def policy_config(policy: Any) -> dict:
    """A policy as JSON: its name and fields (TriAttention's statistics by path and fingerprint)."""
    out = {"name": policy.name}
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        if hasattr(value, "meta") and hasattr(value, "path"):  # calibration statistics
            value = {"path": str(value.path), "model_config_sha256": value.meta.get("model_config_sha256")}
        out[field.name] = value
    return out


def build_config(model_dict: dict, dataset: Dataset, settings: EvalSettings, capacity: int) -> dict:
    """Everything that decides a run's records (hashed into its first line)."""
    return {
        "model": model_dict,
        "dataset": {"name": dataset.name, "path": str(dataset.path), "sha256": dataset.sha256,
                    "problems": [p.id for p in dataset.problems]},
        "policy": policy_config(settings.policy),
        "samples": settings.samples, "max_new_tokens": settings.max_new_tokens,
        "sampling": dataclasses.asdict(settings.sampling), "seed": settings.seed,
        "engine": {"slots": settings.slots, "capacity": capacity, "chunk": settings.chunk,
                   "platform": jax.default_backend(),
                   "mesh": None if settings.mesh is None else dict(settings.mesh.shape)},
        "prompt": {"math": tasks.MATH_INSTRUCTION, "gpqa": tasks.GPQA_INSTRUCTION,
                   "template_kwargs": settings.template_kwargs},
        "grader": grading.GRADER, "versions": versions(),
    }


def sample_seed(base: int, problem_id: str, sample: int) -> int:
    """A non-negative int32 seed of one (problem, sample), independent of order and resumption."""
    return int.from_bytes(hashlib.sha256(f"{base}:{problem_id}:{sample}".encode()).digest()[:4], "little") >> 1


def _encode(model: Model, problem: Problem, settings: EvalSettings) -> list[int]:
    return encode_prompt(model, tasks.user_message(problem), chat=True, **settings.template_kwargs)


def run_eval(
    model: Model,
    model_dict: dict,
    dataset: Dataset,
    settings: EvalSettings,
    out: str | Path,
    *,
    progress: bool = True,
    shard: tuple[int, int] | None = None,
) -> RunSummary:
    """Generate `settings.samples` per problem of `dataset`, grade them, append them to `out`.

    shard (index, count): this process's share of a run split over `count` processes: problems
    index, index + count, ... (all samples of a problem in one shard), recorded in the
    configuration as "shard"; `records.merge_shards` (`randkv report`) joins the shard files."""
    problems = dataset.problems
    if not problems:
        raise ValueError(f"{dataset.path}: the dataset has no problems")
    if any(p.task == "math" for p in problems) and importlib.util.find_spec("math_verify") is None:
        raise ValueError("grading math answers needs math-verify: pip install 'randkv-jax[eval]'")
    if any(p.task == "code" for p in problems) and not settings.unsafe_code:
        ok, why = sandbox.isolation_available()
        if not ok:
            raise sandbox.SandboxUnavailable(
                f"LiveCodeBench programs must run isolated, and isolation is unavailable here ({why}); "
                f"pass --unsafe-code-execution to run them with resource limits only")
    prompts = {p.id: _encode(model, p, settings) for p in problems}  # all: every shard has the same capacity
    longest = max(map(len, prompts.values()))
    capacity = -(-max(bucket(longest), settings.policy.capacity(longest, settings.max_new_tokens)) // 128) * 128
    config = build_config(model_dict, dataset, settings, capacity)
    if shard is not None:
        if not (isinstance(shard[1], int) and 0 <= shard[0] < shard[1]):
            raise ValueError(f"shard {shard}: expected (index, count) with 0 <= index < count")
        config["shard"] = {"index": shard[0], "count": shard[1]}
    start = time.perf_counter()
    with RunWriter(out, config) as writer:
        done = writer.run.done() if writer.run else set()
        writer.write({"kind": "session", "started": time.time(), "host": host_platform.node(),
                      "resumed_with": len(done)})
        mine = problems if shard is None else problems[shard[0]::shard[1]]
        todo = [(p, j) for p in mine for j in range(settings.samples) if (p.id, j) not in done]
        summary = _generate_and_grade(model, prompts, todo, settings, capacity, writer, dataset.name, progress)
    return RunSummary(Path(out), len(mine) * settings.samples, len(done), summary[0], summary[1],
                      time.perf_counter() - start)


def _generate_and_grade(model, prompts, todo, settings, capacity, writer, dataset_name, progress):
    from randkv_jax.progress import ProgressBar

    engine = Engine(model, policy=settings.policy, slots=settings.slots, capacity=capacity,
                    max_new_tokens=settings.max_new_tokens, temperature=settings.sampling.temperature,
                    top_p=settings.sampling.top_p, top_k=settings.sampling.top_k, chunk=settings.chunk,
                    mesh=settings.mesh)
    by_request = {}
    by_problem: dict[str, list[int]] = {}
    for problem, j in todo:
        by_problem.setdefault(problem.id, []).append(j)
    problems = {p.id: p for p, _ in todo}
    for pid, samples in by_problem.items():  # the samples of a problem share one prefill
        seeds = [sample_seed(settings.seed, pid, j) for j in samples]
        ids = engine.submit(prompts[pid], max_new_tokens=settings.max_new_tokens, seed=seeds, n=len(seeds),
                            chat=False)
        by_request.update({rid: (problems[pid], j, s) for rid, j, s in zip(ids, samples, seeds)})
    completed = correct = 0
    judges = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    pending: list[concurrent.futures.Future] = []

    def finish(record):
        nonlocal completed, correct
        writer.write(record)
        completed += 1
        correct += bool(record["strict_correct"])

    bar = ProgressBar(len(todo), desc="samples") if progress else None
    try:
        for c in engine.run(progress=None if bar is None else bar.update):
            problem, j, seed = by_request[c.request_id]
            record = _record(problem, j, seed, c, dataset_name, settings.policy.name)
            if problem.task == "code":
                pending.append(judges.submit(_judge, record, problem, settings.unsafe_code))
            else:
                record["extracted"], record["correct"] = grading.grade(problem.task, c.text or "", problem.answer)
                _strict(record)
                finish(record)
            for future in [f for f in pending if f.done()]:
                pending.remove(future)
                finish(future.result())
            if bar is not None:
                bar.note = f"strict acc {correct}/{completed}"
        for future in pending:
            finish(future.result())
    finally:
        judges.shutdown(wait=True, cancel_futures=False)
        if bar is not None:
            bar.close()
    return completed, correct


def _record(problem: Problem, j: int, seed: int, completion, dataset_name: str, policy: str) -> dict:
    s = completion.stats
    return {
        "kind": "sample", "dataset": dataset_name, "problem_id": problem.id, "sample": j, "seed": seed,
        "task": problem.task, "policy": policy, "gold": problem.answer, "output": completion.text,
        "extracted": None, "correct": None, "terminated": s.finish_reason == "stop",
        "strict_correct": None, "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
        "evictions": s.evictions, "held_after_round": s.held_after_round, "peak_slots": s.peak_slots,
        "finish_reason": s.finish_reason, "completed_at": time.time(),
        "seconds": {"queue": round(s.queue_seconds, 4), "first_token": round(s.first_token_seconds, 4)},
    }


def _strict(record: dict) -> None:
    record["strict_correct"] = bool(record["correct"]) and record["terminated"]


def _judge(record: dict, problem: Problem, unsafe: bool) -> dict:
    program = grading.extract_code(record["output"] or "")
    record["extracted"] = program
    if program is None:
        record["correct"], record["tests"] = False, "no code block"
    else:
        tests = [code_tests.TestCase(*t) for t in problem.tests]
        verdict = code_tests.judge(program, tests, func_name=problem.func_name, unsafe=unsafe)
        record["correct"] = verdict.passed
        record["tests"] = f"{sum(r.passed for r in verdict.results)}/{len(tests)} passed"
    _strict(record)
    return record
