"""`randkv report RUN.jsonl [RUN2.jsonl ...]`: the statistics of finished (or partial) eval runs.

Pure functions over the run files of `randkv eval` (see `randkv_jax.eval.records`) and one entry
point, `report(paths, out_dir=None, paired=True) -> str`, that returns a markdown report and, given
`out_dir`, writes its PNG plots there (`main` is the command line).

A run's dataset is its config's "dataset": a name, or the dict `randkv eval` writes ({"name", "sha256",
"problems", ...}); every sample must come from it (and from its problem list, when there is one).
Partial runs are reported over the samples they finished (the table says "k of N").

Definitions (the same words mean these numbers everywhere in the report):

accuracy
    Mean of the samples' `correct` over all finished (problem, sample) pairs of a run.
strict accuracy
    Mean of `strict_correct`: correct *and* terminated under the token cap (what the paper records).
termination rate
    Mean of `terminated`.
confidence interval of the accuracy (95 % unless asked)
    With one sample per problem the samples are independent trials: the Wilson score interval
    (`accuracy_ci`). With several samples per problem, samples of one problem are correlated (the
    problem's difficulty is shared), so the Wilson interval would be too narrow; the reported
    interval is then a problem-clustered percentile bootstrap (`clustered_bootstrap_ci`): resample
    problems with replacement, take the accuracy over all their samples, 10,000 resamples, fixed
    seed. The table's "CI" column says which one a row uses.
pass@k
    The unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k) for a problem with n
    samples of which c are correct, in the stable product form, averaged over problems
    (`pass_at_k`, `mean_pass_at_k`); k in {1, 2, 4, ..., n} (powers of two up to n, and n).
compression factor
    Mean over samples of (prompt_tokens + new_tokens) / peak_slots: the tokens of the sequence over
    the most entries any layer and KV head held at once. A sample whose cache never ran an eviction
    round held every entry and counts as exactly 1 (a full cache holds one entry less than the
    sequence, as the last token is never written; that is not compression). Full attention is 1.
wall time of a run
    The run may be resumed: each (re)start writes a session record. Each sample is attributed to the
    latest session that started at or before its `completed_at`; a session's time is the last
    `completed_at` among its samples minus its start (0 if it finished none); the run's wall time is
    the sum over sessions (so time between a kill and the next restart is not counted).
correct per hour
    Strict-correct samples of the run / its wall time in hours.
paired comparison (`paired_comparison`)
    Two runs on the same problems and seeds: samples matched by (problem_id, sample), the seeds of
    every pair must agree. Per problem d_i = mean correctness of A - mean of B. The paired bootstrap
    resamples problems (10,000 resamples, fixed seed) for a percentile CI of the mean difference and
    a two-sided p-value from the null-centred bootstrap distribution,
    p = (1 + #{|d* - d| >= |d|}) / (1 + resamples). The sign test is the exact two-sided binomial
    test (p = 1/2) on the problems where A and B differ (scipy.stats.binomtest). p-values are not
    adjusted for the number of comparisons.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from randkv_jax.eval.records import Run, RunFileError, merge_shards, read_run

__all__ = [
    "ReportError", "accuracy_ci", "clustered_bootstrap_ci", "pass_at_k", "mean_pass_at_k", "pass_ks",
    "compression_factor", "wall_seconds", "correct_per_hour", "PairedComparison", "paired_comparison",
    "RunSummary", "summarize", "load_runs", "markdown", "plot_accuracy_vs_compression", "plot_policies",
    "report", "main",
]

RESAMPLES = 10_000
SEED = 0


class ReportError(ValueError):
    """Inputs the report refuses: overlapping, inconsistent or not comparable runs."""


# ---------------------------------------------------------------------------------------------
# intervals


def _z(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    from scipy.stats import norm

    return float(norm.ppf(0.5 + level / 2))


def accuracy_ci(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion.

    With p = successes / trials, n = trials and z the two-sided normal quantile of `level`:
        centre = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)
    Unlike the Wald interval it stays inside [0, 1] and keeps its coverage near 0 and 1 (it equals
    scipy.stats.binomtest(...).proportion_ci(method="wilson")). Assumes independent trials.
    """
    if trials <= 0:
        raise ValueError("accuracy_ci needs at least one trial")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, {trials}], got {successes}")
    z = _z(level)
    n, p = float(trials), successes / trials
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _resample_indices(rng: np.random.Generator, problems: int, resamples: int):
    """Bootstrap index rows (resamples x problems), in chunks that keep memory bounded."""
    chunk = max(1, min(resamples, 2_000_000 // max(problems, 1)))
    done = 0
    while done < resamples:
        rows = min(chunk, resamples - done)
        yield rng.integers(0, problems, size=(rows, problems))
        done += rows


def clustered_bootstrap_ci(
    successes: Sequence[float], trials: Sequence[float], level: float = 0.95,
    resamples: int = RESAMPLES, seed: int = SEED,
) -> tuple[float, float]:
    """Problem-clustered percentile bootstrap CI of the mean accuracy.

    `successes[i]` / `trials[i]`: correct samples and samples of problem i. Each resample draws
    problems with replacement and takes the accuracy over all their samples (sum of successes / sum
    of trials, i.e. the mean over their samples); the interval is the (1-level)/2 and (1+level)/2
    quantiles of the resampled accuracies. Deterministic for a given seed.
    """
    s = np.asarray(successes, dtype=np.float64)
    t = np.asarray(trials, dtype=np.float64)
    if s.ndim != 1 or s.shape != t.shape or not len(s):
        raise ValueError("clustered_bootstrap_ci needs one (successes, trials) pair per problem")
    if np.any(t <= 0) or np.any(s < 0) or np.any(s > t):
        raise ValueError("every problem needs 0 <= successes <= trials and trials > 0")
    _z(level)
    rng = np.random.default_rng(seed)
    stats = np.concatenate([s[idx].sum(1) / t[idx].sum(1) for idx in _resample_indices(rng, len(s), resamples)])
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


# ---------------------------------------------------------------------------------------------
# pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    n samples, c of them correct. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms
    the binomial coefficients (no overflow for large n); 1 when fewer than k samples are wrong.
    """
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems; `counts` holds one (n, c) per problem."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return float(np.mean(values))


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, the powers of two up to n, and n."""
    ks = {1, n} if n >= 1 else set()
    k = 2
    while k <= n:
        ks.add(k)
        k *= 2
    return sorted(ks)


# ---------------------------------------------------------------------------------------------
# per-run quantities


def _as_run(run: Run | str | Path) -> Run:
    return run if isinstance(run, Run) else read_run(run)


def compression_factor(samples: Iterable[dict]) -> float:
    """Mean over samples of (prompt_tokens + new_tokens) / peak_slots (1 for a sample never evicted).

    See the module docstring; full attention never evicts, so it is exactly 1.
    """
    factors = []
    for r in samples:
        if not r["evictions"]:
            factors.append(1.0)
        else:
            if r["peak_slots"] <= 0:
                raise ReportError(f"sample {r['problem_id']!r}/{r['sample']} evicted but held no entries")
            factors.append((r["prompt_tokens"] + r["new_tokens"]) / r["peak_slots"])
    if not factors:
        raise ValueError("compression_factor needs at least one sample")
    return float(np.mean(factors))


def wall_seconds(run: Run | str | Path) -> float | None:
    """The run's wall time: sum over sessions of (last completed_at of its samples - its start).

    Samples go to the latest session started at or before their completed_at. None when the run has
    no session record; a sample completed before the first session started is refused.
    """
    run = _as_run(run)
    if not run.sessions:
        return None
    starts = sorted(float(s["started"]) for s in run.sessions)
    last = [None] * len(starts)
    for r in run.samples:
        t = float(r["completed_at"])
        i = int(np.searchsorted(starts, t, side="right")) - 1
        if i < 0:
            raise ReportError(
                f"{run.path}: sample {r['problem_id']!r}/{r['sample']} completed at {t} before the first "
                f"session started ({starts[0]})")
        last[i] = t if last[i] is None else max(last[i], t)
    return float(sum(end - start for start, end in zip(starts, last) if end is not None))


def correct_per_hour(run: Run | str | Path) -> float | None:
    """Strict-correct samples per wall-clock hour of the run (None without a positive wall time)."""
    run = _as_run(run)
    seconds = wall_seconds(run)
    if not seconds:
        return None
    return sum(bool(r["strict_correct"]) for r in run.samples) / (seconds / 3600.0)


def _by_problem(samples: Iterable[dict], field: str = "correct") -> dict:
    """problem_id -> list of the field's values (in order of first appearance)."""
    out: dict = {}
    for r in samples:
        out.setdefault(r["problem_id"], []).append(float(bool(r[field])))
    return out


def _policy_label(policy: dict) -> str:
    name = str(policy.get("name", "?"))
    budget = policy.get("budget")
    return f"{name} (T={budget})" if budget is not None and name != "full" else name


def _dataset_name(config: dict) -> str | None:
    """The config's dataset: a name, or (as `randkv eval` writes it) a dict with "name", "sha256", "problems"."""
    dataset = config.get("dataset")
    if isinstance(dataset, dict):
        dataset = dataset.get("name")
    return None if dataset is None else str(dataset)


def _dataset_field(config: dict, key: str):
    dataset = config.get("dataset")
    return dataset.get(key) if isinstance(dataset, dict) else None


def _model_name(config: dict) -> str:
    model = config.get("model")
    if isinstance(model, dict):
        if model.get("name"):
            return str(model["name"])
        if model.get("path"):
            return Path(str(model["path"])).name
        return "?"
    return str(model) if model is not None else "?"


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """The numbers of one run's table row (see the module docstring for each definition)."""

    path: Path
    dataset: str
    model: str
    policy: str  # name with its budget, e.g. "random (T=1024)"
    policy_name: str
    budget: int | None
    samples_per_problem: int  # the config's n
    problems: int
    trials: int  # finished (problem, sample) pairs
    expected: int | None  # problems x n of the config's dataset, when it lists its problems
    accuracy: float
    ci: tuple[float, float]
    ci_method: str  # "Wilson" or "bootstrap (problems)"
    strict_accuracy: float
    termination_rate: float
    pass_at_k: dict[int, float]
    mean_new_tokens: float
    mean_evictions: float
    compression: float
    wall_seconds: float | None
    correct_per_hour: float | None


def _expected(config: dict) -> int | None:
    problems, n = _dataset_field(config, "problems"), config.get("samples")
    return len(problems) * n if isinstance(problems, list) and isinstance(n, int) else None


def summarize(run: Run | str | Path, level: float = 0.95, resamples: int = RESAMPLES, seed: int = SEED) -> RunSummary:
    """One run's row: accuracies with their interval, pass@k, costs, compression, throughput."""
    run = _as_run(run)
    _check_run(run)
    samples = run.samples
    config = run.config
    per_problem = _by_problem(samples)
    succ = np.array([sum(v) for v in per_problem.values()])
    tri = np.array([len(v) for v in per_problem.values()])
    trials = int(tri.sum())
    if tri.max() > 1:
        ci = clustered_bootstrap_ci(succ, tri, level, resamples, seed)
        method = "bootstrap (problems)"
    else:
        ci = accuracy_ci(int(succ.sum()), trials, level)
        method = "Wilson"
    counts = list(zip(tri.tolist(), succ.astype(int).tolist()))
    n_min = int(tri.min())
    pak = {k: mean_pass_at_k(counts, k) for k in pass_ks(n_min)}
    policy = config.get("policy") or {}
    if not isinstance(policy, dict):
        policy = {"name": str(policy)}
    return RunSummary(
        path=run.path, dataset=str(_dataset_name(config)), model=_model_name(config),
        policy=_policy_label(policy), policy_name=str(policy.get("name", "?")), budget=policy.get("budget"),
        samples_per_problem=int(config.get("samples") or n_min), problems=len(per_problem), trials=trials,
        expected=_expected(config),
        accuracy=float(succ.sum() / trials), ci=ci, ci_method=method,
        strict_accuracy=float(np.mean([bool(r["strict_correct"]) for r in samples])),
        termination_rate=float(np.mean([bool(r["terminated"]) for r in samples])),
        pass_at_k=pak,
        mean_new_tokens=float(np.mean([r["new_tokens"] for r in samples])),
        mean_evictions=float(np.mean([r["evictions"] for r in samples])),
        compression=1.0 if policy.get("name") == "full" else compression_factor(samples),
        wall_seconds=wall_seconds(run), correct_per_hour=correct_per_hour(run),
    )


# ---------------------------------------------------------------------------------------------
# input checks


def _check_run(run: Run) -> None:
    """A run must be self-consistent: samples from its dataset, one policy, no duplicated pair."""
    if not run.samples:
        raise ReportError(f"{run.path}: the run has no finished samples")
    dataset = _dataset_name(run.config)
    if dataset is None:
        raise ReportError(f"{run.path}: the configuration names no dataset")
    other = sorted({str(r["dataset"]) for r in run.samples if r["dataset"] != dataset})
    if other:
        raise ReportError(f"{run.path}: samples from dataset(s) {', '.join(other)} in a run of {dataset!r}")
    policies = {repr(r["policy"]) for r in run.samples}
    if len(policies) > 1:
        raise ReportError(f"{run.path}: samples from more than one policy ({', '.join(sorted(policies))})")
    seen = set()
    for r in run.samples:
        key = (r["problem_id"], r["sample"])
        if key in seen:
            raise ReportError(f"{run.path}: problem {key[0]!r} sample {key[1]} appears twice")
        seen.add(key)
    listed = _dataset_field(run.config, "problems")
    if isinstance(listed, list):
        stray = sorted({str(r["problem_id"]) for r in run.samples} - {str(p) for p in listed})
        if stray:
            raise ReportError(f"{run.path}: problem(s) {', '.join(stray[:5])} are not in the dataset {dataset!r} "
                              f"of the configuration")
    n = run.config.get("samples")
    if isinstance(n, int) and n > 0:
        bad = [r for r in run.samples if not 0 <= int(r["sample"]) < n]
        if bad:
            raise ReportError(f"{run.path}: sample index {bad[0]['sample']} outside the configured {n} samples")


def load_runs(paths: Sequence[str | Path | Run]) -> list[Run]:
    """Read and check the runs; the process shards of one run are merged into it (refused when
    one is missing or two overlap); refuse a file given twice or two files holding the same run."""
    if not paths:
        raise ReportError("no run files given")
    runs, seen_paths, seen_hash = [], {}, {}
    read = []
    for p in paths:
        run = _as_run(p)
        key = Path(run.path).resolve()
        if key in seen_paths:
            raise ReportError(f"{run.path} is given twice (as {seen_paths[key]} and {p})")
        seen_paths[key] = p
        read.append(run)
    try:
        read = merge_shards(read)  # one run per complete set of process shards
    except RunFileError as e:
        raise ReportError(str(e)) from None
    for run in read:
        if run.hash in seen_hash:
            raise ReportError(
                f"{run.path} and {seen_hash[run.hash]} hold the same configuration (hash {run.hash[:12]}): "
                f"the same run twice? Resume one run file instead of reporting copies")
        seen_hash[run.hash] = run.path
        _check_run(run)
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------
# paired comparison


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    """A - B on the same problems and seeds (`difference` > 0: A is better)."""

    a: str
    b: str
    problems: int
    pairs: int  # matched (problem, sample) pairs
    accuracy_a: float
    accuracy_b: float
    difference: float
    ci: tuple[float, float]
    p_bootstrap: float
    a_better: int  # problems where A's mean correctness is higher
    b_better: int
    p_sign: float
    resamples: int
    level: float


def _pair_key_index(run: Run) -> dict:
    return {(r["problem_id"], r["sample"]): r for r in run.samples}


def paired_comparison(
    run_a: Run | str | Path, run_b: Run | str | Path, field: str = "correct", level: float = 0.95,
    resamples: int = RESAMPLES, seed: int = SEED,
) -> PairedComparison:
    """Paired bootstrap over problems and exact sign test of A - B (see the module docstring).

    Refuses (ReportError) runs of different datasets, or that do not hold the same
    (problem_id, sample) pairs with the same seed for each.
    """
    run_a, run_b = _as_run(run_a), _as_run(run_b)
    _check_run(run_a)
    _check_run(run_b)
    da, db = _dataset_name(run_a.config), _dataset_name(run_b.config)
    if da != db:
        raise ReportError(f"{run_a.path} ({da}) and {run_b.path} ({db}) are runs of different datasets")
    sa, sb = _dataset_field(run_a.config, "sha256"), _dataset_field(run_b.config, "sha256")
    if sa and sb and sa != sb:
        raise ReportError(f"{run_a.path} and {run_b.path} ran different versions of dataset {da!r} "
                          f"(sha256 {sa[:12]} vs {sb[:12]})")
    ia, ib = _pair_key_index(run_a), _pair_key_index(run_b)
    only_a, only_b = set(ia) - set(ib), set(ib) - set(ia)
    if only_a or only_b:
        example = next(iter(only_a or only_b))
        raise ReportError(
            f"{run_a.path} and {run_b.path} do not hold the same problems and samples: {len(only_a)} pair(s) "
            f"only in the first, {len(only_b)} only in the second (e.g. problem {example[0]!r} sample {example[1]})")
    seeds = [k for k in ia if ia[k]["seed"] != ib[k]["seed"]]
    if seeds:
        k = seeds[0]
        raise ReportError(
            f"{run_a.path} and {run_b.path} used different seeds for {len(seeds)} of {len(ia)} samples "
            f"(e.g. problem {k[0]!r} sample {k[1]}: {ia[k]['seed']} vs {ib[k]['seed']}); a paired comparison "
            f"needs the same problems and seeds")
    problems: dict = {}
    for k in ia:
        problems.setdefault(k[0], []).append((float(bool(ia[k][field])), float(bool(ib[k][field]))))
    n = np.array([len(v) for v in problems.values()], dtype=np.float64)
    d = np.array([np.mean([a - b for a, b in v]) for v in problems.values()])
    acc_a = sum(a for v in problems.values() for a, _ in v) / n.sum()
    acc_b = sum(b for v in problems.values() for _, b in v) / n.sum()
    weighted = d * n  # per-problem sums of differences: the statistic is the mean over samples
    diff = float(weighted.sum() / n.sum())
    _z(level)
    rng = np.random.default_rng(seed)
    stats = np.concatenate([weighted[idx].sum(1) / n[idx].sum(1) for idx in _resample_indices(rng, len(d), resamples)])
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    # null-centred bootstrap: how often a resample deviates from the estimate as far as the estimate from 0
    tol = 1e-12
    extreme = int(np.count_nonzero(np.abs(stats - diff) >= abs(diff) - tol))
    p_boot = min(1.0, (1 + extreme) / (1 + resamples))
    a_better, b_better = int(np.count_nonzero(d > tol)), int(np.count_nonzero(d < -tol))
    if a_better + b_better:
        from scipy.stats import binomtest

        p_sign = float(binomtest(a_better, a_better + b_better, 0.5).pvalue)
    else:
        p_sign = 1.0
    return PairedComparison(
        a=str(run_a.path), b=str(run_b.path), problems=len(d), pairs=len(ia), accuracy_a=float(acc_a),
        accuracy_b=float(acc_b), difference=diff, ci=(float(low), float(high)), p_bootstrap=float(p_boot),
        a_better=a_better, b_better=b_better, p_sign=p_sign, resamples=resamples, level=level,
    )


# ---------------------------------------------------------------------------------------------
# markdown


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _run_names(runs: Sequence[Run]) -> list[str]:
    """Short names for the runs: file stems, with the index when two stems coincide."""
    stems = [Path(r.path).stem for r in runs]
    return [f"{s} (#{i + 1})" if stems.count(s) > 1 else s for i, s in enumerate(stems)]


def _pairs_to_compare(summaries: Sequence[RunSummary]) -> list[tuple[int, int]]:
    """Every pair of runs on the same dataset and model, in input order."""
    return [(i, j) for i in range(len(summaries)) for j in range(i + 1, len(summaries))
            if (summaries[i].dataset, summaries[i].model) == (summaries[j].dataset, summaries[j].model)]


def markdown(
    runs: Sequence[Run], summaries: Sequence[RunSummary], comparisons: Sequence[tuple[int, int, object]] = (),
    level: float = 0.95, plots: Sequence[Path] = (),
) -> str:
    """The report: one row per run, then the paired comparisons (`comparisons`: (i, j, result or
    the reason they could not be paired)), then the plots."""
    names = _run_names(runs)
    ks = sorted({k for s in summaries for k in s.pass_at_k})
    lvl = f"{100 * level:g}%"
    head = (["run", "dataset", "model", "policy", "n", "problems", "samples", f"accuracy % [{lvl} CI]", "CI",
             "strict %", "terminated %"] + [f"pass@{k} %" for k in ks]
            + ["mean new tokens", "mean evictions", "compression ×", "correct/h"])
    lines = ["# randkv report", "", "## Runs", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, s in zip(names, summaries):
        done = str(s.trials) if s.expected in (None, s.trials) else f"{s.trials} of {s.expected}"
        row = [name, s.dataset, s.model, s.policy, s.samples_per_problem, s.problems, done,
               f"{_pct(s.accuracy)} [{_pct(s.ci[0])}, {_pct(s.ci[1])}]", s.ci_method,
               _pct(s.strict_accuracy), _pct(s.termination_rate)]
        row += [_pct(s.pass_at_k[k]) if k in s.pass_at_k else "—" for k in ks]
        row += [f"{s.mean_new_tokens:.0f}", f"{s.mean_evictions:.1f}", f"{s.compression:.2f}",
                "—" if s.correct_per_hour is None else f"{s.correct_per_hour:.1f}"]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines += ["",
              (f"accuracy: mean `correct` over finished samples; CI: Wilson score interval with one sample per "
              f"problem, problem-clustered percentile bootstrap ({RESAMPLES:,} resamples) with several. "
              f"strict: correct and terminated under the cap. pass@k: unbiased estimator (Chen et al. 2021), "
              f"averaged over problems. compression: mean (prompt + new tokens) / peak entries held per KV head. "
              f"correct/h: strict-correct samples per hour of the sessions' wall time.")]
    if comparisons:
        chead = ["A", "B", "dataset", "problems", "A %", "B %", f"A − B (pts) [{lvl} CI]", "p (bootstrap)",
                 "A better / B better", "p (sign test)"]
        lines += ["", "## Paired comparisons", ""]
        if any(isinstance(c, PairedComparison) for _, _, c in comparisons):
            lines += ["| " + " | ".join(chead) + " |", "|" + "|".join("---" for _ in chead) + "|"]
        notes = []
        for i, j, c in comparisons:
            if isinstance(c, PairedComparison):
                row = [names[i], names[j], summaries[i].dataset, c.problems, _pct(c.accuracy_a), _pct(c.accuracy_b),
                       f"{100 * c.difference:+.1f} [{100 * c.ci[0]:+.1f}, {100 * c.ci[1]:+.1f}]",
                       # the smallest p the resamples can give: report it as a bound
                       f"≤ {_p(c.p_bootstrap)}" if c.p_bootstrap <= 1.5 / (1 + c.resamples) else _p(c.p_bootstrap),
                       f"{c.a_better} / {c.b_better}", _p(c.p_sign)]
                lines.append("| " + " | ".join(_cell(x) for x in row) + " |")
            else:
                notes.append(f"- {names[i]} vs {names[j]}: not paired ({c})")
        lines += ["", ("Paired on (problem, sample) with the same seeds; bootstrap over problems "
                      f"({RESAMPLES:,} resamples), sign test on the problems where the two differ; "
                      "p-values not adjusted for multiple comparisons.")]
        if notes:
            lines += [""] + notes
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# plots


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "dataset"


def figure(width: float = 6.4, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)  # the Agg canvas, without touching pyplot's global backend
    return fig


def _by_dataset(summaries: Sequence[RunSummary]) -> dict[str, list[RunSummary]]:
    out: dict[str, list[RunSummary]] = {}
    for s in summaries:
        out.setdefault(s.dataset, []).append(s)
    return out


def _yerr(group: Sequence[RunSummary]) -> np.ndarray:
    return np.array([[100 * (s.accuracy - s.ci[0]) for s in group], [100 * (s.ci[1] - s.accuracy) for s in group]])


def plot_accuracy_vs_compression(summaries: Sequence[RunSummary], out_dir: str | Path) -> list[Path]:
    """Per dataset: accuracy (error bars = its CI) against the compression factor, one point per run."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for dataset, group in _by_dataset(summaries).items():
        fig = figure()
        ax = fig.add_subplot()
        x = [s.compression for s in group]
        y = [100 * s.accuracy for s in group]
        ax.errorbar(x, y, yerr=_yerr(group), fmt="o", capsize=4)
        for s, xi, yi in zip(group, x, y):
            ax.annotate(s.policy, (xi, yi), textcoords="offset points", xytext=(6, 4), fontsize=8)
        if max(x) / min(x) > 4:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("compression factor (tokens / peak entries held)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"{dataset}: accuracy vs compression")
        ax.grid(alpha=0.3)
        path = out_dir / f"accuracy_vs_compression_{_slug(dataset)}.png"
        fig.tight_layout()
        fig.savefig(path)
        written.append(path)
    return written


def plot_policies(summaries: Sequence[RunSummary], out_dir: str | Path) -> list[Path]:
    """Per dataset: one bar per run (labelled by policy), error bars = its accuracy CI."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for dataset, group in _by_dataset(summaries).items():
        fig = figure(max(4.0, 1.1 * len(group) + 2), 4.2)
        ax = fig.add_subplot()
        pos = np.arange(len(group))
        labels = [s.policy if sum(t.policy == s.policy for t in group) == 1 else f"{s.policy}\n{s.model}"
                  for s in group]
        ax.bar(pos, [100 * s.accuracy for s in group], yerr=_yerr(group), capsize=4, color="tab:blue", alpha=0.8)
        ax.set_xticks(pos, labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 100)
        ax.set_title(f"{dataset}: accuracy by policy")
        ax.grid(axis="y", alpha=0.3)
        path = out_dir / f"policies_{_slug(dataset)}.png"
        fig.tight_layout()
        fig.savefig(path)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# entry points


def report(paths: Sequence[str | Path | Run], out_dir: str | Path | None = None, paired: bool = True,
           level: float = 0.95) -> str:
    """The markdown report of the runs; with `out_dir`, it and the PNG plots are written there too
    (report.md, accuracy_vs_compression_DATASET.png, policies_DATASET.png).

    `paired`: compare every pair of runs on the same dataset and model (pairs that do not share the
    problems and seeds are listed with the reason, not compared).
    """
    runs = load_runs(paths)
    summaries = [summarize(r, level) for r in runs]
    comparisons = []
    if paired:
        for i, j in _pairs_to_compare(summaries):
            try:
                comparisons.append((i, j, paired_comparison(runs[i], runs[j], level=level)))
            except ReportError as e:
                comparisons.append((i, j, str(e)))
    plots: list[Path] = []
    if out_dir is not None:
        plots = plot_accuracy_vs_compression(summaries, out_dir) + plot_policies(summaries, out_dir)
    text = markdown(runs, summaries, comparisons, level, plots)
    if out_dir is not None:
        (Path(out_dir) / "report.md").write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """`randkv report RUN.jsonl [RUN2.jsonl ...] [--out-dir DIR] [--out REPORT.md] [--no-paired]`."""
    parser = argparse.ArgumentParser(prog="randkv report", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run files of `randkv eval`")
    parser.add_argument("--out-dir", metavar="DIR", help="write report.md and the PNG plots to DIR")
    parser.add_argument("--out", metavar="FILE", help="write the markdown to FILE (default: stdout)")
    parser.add_argument("--no-paired", action="store_true", help="skip the paired comparisons")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level (default 0.95)")
    args = parser.parse_args(argv)
    try:
        text = report(args.runs, out_dir=args.out_dir, paired=not args.no_paired, level=args.level)
    except (ReportError, ValueError) as e:
        print(f"randkv report: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(text)
    if not args.out:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
