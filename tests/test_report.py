"""`randkv report`: intervals, pass@k, paired comparisons, throughput, markdown and plots on synthetic runs."""

from __future__ import annotations

import itertools
import math
import shutil

import numpy as np
import pytest
from scipy.stats import binomtest

from randkv_jax.eval import report as rp
from randkv_jax.eval.records import RunWriter, read_run

RANDOM = {"name": "random", "budget": 1024, "window": 64, "interval": 64, "protect": "prompt"}
FULL = {"name": "full"}


def config(policy=RANDOM, dataset="gsm8k", samples=1, model="tiny", **extra):
    return {"dataset": dataset, "policy": dict(policy), "model": {"name": model, "path": f"/models/{model}"},
            "samples": samples, "max_new_tokens": 4096, "grader": "math-verify", **extra}


def sample(pid, j, correct, *, seed=None, dataset="gsm8k", policy="random", terminated=True, completed_at=1000.0,
           prompt_tokens=100, new_tokens=900, evictions=3, peak_slots=250):
    return {"kind": "sample", "problem_id": pid, "sample": j, "seed": 1000 * pid + j if seed is None else seed,
            "dataset": dataset, "policy": policy, "correct": bool(correct), "terminated": terminated,
            "strict_correct": bool(correct) and terminated, "extracted": "1" if correct else "0", "gold": "1",
            "output": "...", "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "evictions": evictions,
            "held_after_round": 200 if evictions else 0, "peak_slots": peak_slots, "finish_reason": "eos",
            "completed_at": completed_at}


def write_run(path, cfg, samples, sessions=(0.0,)):
    with RunWriter(path, cfg) as w:
        for t in sessions:
            w.write({"kind": "session", "started": t})
        for s in samples:
            w.write(s)
    return path


def outcomes_run(path, outcomes, n=1, policy=RANDOM, **cfg_extra):
    """outcomes[pid][j] -> correct; one session at 0, samples completing at pid + 1 seconds."""
    name = policy["name"]
    records = [sample(pid, j, c, policy=name, completed_at=float(pid + 1), dataset=cfg_extra.get("dataset", "gsm8k"),
                      evictions=0 if name == "full" else 3, peak_slots=999 if name == "full" else 250)
               for pid, row in enumerate(outcomes) for j, c in enumerate(row)]
    return write_run(path, config(policy, samples=n, **cfg_extra), records)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s,n", [(0, 1), (1, 1), (0, 10), (3, 10), (10, 10), (57, 100), (1, 500), (499, 500)])
@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_wilson_interval_matches_scipy(s, n, level):
    ref = binomtest(s, n).proportion_ci(confidence_level=level, method="wilson")
    np.testing.assert_allclose(rp.accuracy_ci(s, n, level), (ref.low, ref.high), rtol=1e-10, atol=1e-12)


def test_accuracy_ci_refuses_bad_input():
    for args in [(0, 0), (3, 2), (-1, 5)]:
        with pytest.raises(ValueError):
            rp.accuracy_ci(*args)
    with pytest.raises(ValueError):
        rp.accuracy_ci(1, 2, level=1.0)


def test_pass_at_k_matches_enumeration_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert rp.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert rp.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert 0.0 < rp.pass_at_k(100_000, 1, 50) < 1.0  # stable: no huge binomials
    assert rp.mean_pass_at_k([(4, 0), (4, 4)], 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        rp.pass_at_k(4, 2, 5)


def test_pass_ks():
    assert rp.pass_ks(1) == [1]
    assert rp.pass_ks(8) == [1, 2, 4, 8]
    assert rp.pass_ks(6) == [1, 2, 4, 6]


def test_clustered_bootstrap_is_deterministic_and_wider_than_wilson_for_correlated_samples():
    # 40 problems x 8 samples, all-or-nothing per problem: effectively 40 trials, not 320
    succ, trials = [8] * 20 + [0] * 20, [8] * 40
    a = rp.clustered_bootstrap_ci(succ, trials)
    assert a == rp.clustered_bootstrap_ci(succ, trials)
    mixed = ([3, 5, 1, 8, 0, 7, 2, 6] * 5, trials)
    assert rp.clustered_bootstrap_ci(*mixed, seed=0) != rp.clustered_bootstrap_ci(*mixed, seed=1)  # the seed matters
    wilson = rp.accuracy_ci(160, 320)
    assert a[0] < 0.5 < a[1]
    assert a[1] - a[0] > 1.5 * (wilson[1] - wilson[0])


# ---------------------------------------------------------------------------------------------


def test_paired_identical_runs(tmp_path):
    rng = np.random.default_rng(0)
    outcomes = (rng.random((30, 2)) < 0.5).tolist()
    a = outcomes_run(tmp_path / "a.jsonl", outcomes, n=2)
    b = outcomes_run(tmp_path / "b.jsonl", outcomes, n=2, policy=FULL)
    c = rp.paired_comparison(a, b)
    assert c.difference == 0.0 and c.ci == (0.0, 0.0)
    assert c.p_bootstrap == 1.0 and c.p_sign == 1.0
    assert (c.a_better, c.b_better, c.problems, c.pairs) == (0, 0, 30, 60)


def test_paired_clearly_better_run(tmp_path):
    good = outcomes_run(tmp_path / "good.jsonl", [[True]] * 30)
    bad = outcomes_run(tmp_path / "bad.jsonl", [[i % 3 == 0] for i in range(30)], policy=FULL)
    c = rp.paired_comparison(good, bad)
    assert c.difference == pytest.approx(20 / 30)
    assert c.ci[0] > 0.4 and c.ci[1] <= 0.9
    assert c.p_bootstrap < 1e-3
    assert (c.a_better, c.b_better) == (20, 0)
    assert c.p_sign == pytest.approx(binomtest(20, 20).pvalue) and c.p_sign < 1e-5
    rev = rp.paired_comparison(bad, good)
    assert rev.difference == pytest.approx(-c.difference) and rev.p_bootstrap < 1e-3
    assert rp.paired_comparison(good, bad) == c  # deterministic


def test_paired_sign_test_counts_discordant_problems(tmp_path):
    # 4 samples per problem: A better on 8 problems, B better on 3, equal on 9
    a_rows, b_rows = [], []
    for i in range(20):
        if i < 8:
            a, b = [1, 1, 1, 0], [1, 0, 0, 0]
        elif i < 11:
            a, b = [0, 0, 0, 0], [1, 0, 1, 0]
        else:
            a = b = [1, 0, 1, 1] if i % 2 else [0, 0, 0, 0]
        a_rows.append([bool(x) for x in a])
        b_rows.append([bool(x) for x in b])
    c = rp.paired_comparison(outcomes_run(tmp_path / "a.jsonl", a_rows, n=4),
                             outcomes_run(tmp_path / "b.jsonl", b_rows, n=4, policy=FULL))
    assert (c.a_better, c.b_better) == (8, 3)
    assert c.p_sign == pytest.approx(binomtest(8, 11, 0.5).pvalue, rel=1e-12)
    assert c.difference == pytest.approx((8 * 2 - 3 * 2) / 80)
    assert 0.0 < c.p_bootstrap < 1.0 and c.ci[0] < c.difference < c.ci[1]


def test_paired_refuses_other_problems_or_seeds(tmp_path):
    a = outcomes_run(tmp_path / "a.jsonl", [[True, False]] * 5, n=2)
    fewer = outcomes_run(tmp_path / "fewer.jsonl", [[True, False]] * 4, n=2, policy=FULL)
    with pytest.raises(rp.ReportError, match="same problems"):
        rp.paired_comparison(a, fewer)
    reseeded = [sample(pid, j, True, policy="full", seed=7 if (pid, j) == (2, 1) else None, evictions=0)
                for pid in range(5) for j in range(2)]
    other = write_run(tmp_path / "seeds.jsonl", config(FULL, samples=2), reseeded)
    with pytest.raises(rp.ReportError, match="different seeds for 1 of 10"):
        rp.paired_comparison(a, other)
    math_run = outcomes_run(tmp_path / "math.jsonl", [[True, False]] * 5, n=2, policy=FULL, dataset="math500")
    with pytest.raises(rp.ReportError, match="different datasets"):
        rp.paired_comparison(a, math_run)


# ---------------------------------------------------------------------------------------------


def test_correct_per_hour_over_two_sessions(tmp_path):
    # session 1 starts at 1000 and finishes samples at 1100 and 1600 (killed); session 2 restarts at 5000
    # and finishes at 5200 and 5800: wall time (1600 - 1000) + (5800 - 5000) = 1400 s
    records = [sample(0, 0, True, completed_at=1100.0), sample(1, 0, True, completed_at=1600.0),
               sample(2, 0, False, completed_at=5200.0), sample(3, 0, True, completed_at=5800.0, terminated=False),
               sample(4, 0, True, completed_at=5300.0)]
    path = write_run(tmp_path / "r.jsonl", config(), records, sessions=(1000.0, 5000.0))
    assert rp.wall_seconds(path) == pytest.approx(1400.0)
    assert rp.correct_per_hour(path) == pytest.approx(3 / (1400 / 3600))  # strict: the unterminated one is out
    # a third session that finished nothing adds no time
    path3 = write_run(tmp_path / "r3.jsonl", config(), records, sessions=(1000.0, 5000.0, 9000.0))
    assert rp.wall_seconds(path3) == pytest.approx(1400.0)
    early = write_run(tmp_path / "early.jsonl", config(), [sample(0, 0, True, completed_at=10.0)], sessions=(1000.0,))
    with pytest.raises(rp.ReportError, match="before the first session"):
        rp.wall_seconds(early)


def test_compression_factor():
    evicted = [sample(0, 0, True, prompt_tokens=100, new_tokens=900, peak_slots=250),
               sample(1, 0, True, prompt_tokens=100, new_tokens=400, peak_slots=250)]
    assert rp.compression_factor(evicted) == pytest.approx((4.0 + 2.0) / 2)
    never = [sample(0, 0, True, evictions=0, prompt_tokens=100, new_tokens=20, peak_slots=119)]
    assert rp.compression_factor(never) == 1.0


def test_summary_of_a_multi_sample_run(tmp_path):
    rows = [[True] * 4, [True, False, False, False], [False] * 4, [True, True, False, False]]
    s = rp.summarize(outcomes_run(tmp_path / "r.jsonl", rows, n=4))
    assert (s.problems, s.trials, s.samples_per_problem) == (4, 16, 4)
    assert s.accuracy == pytest.approx(7 / 16) and s.ci_method.startswith("bootstrap")
    assert sorted(s.pass_at_k) == [1, 2, 4]
    assert s.pass_at_k[1] == pytest.approx(7 / 16)
    assert s.pass_at_k[4] == pytest.approx(3 / 4)
    assert s.pass_at_k[2] == pytest.approx(np.mean([rp.pass_at_k(4, c, 2) for c in (4, 1, 0, 2)]))
    assert s.compression == pytest.approx(4.0) and s.policy == "random (T=1024)"
    one = rp.summarize(outcomes_run(tmp_path / "one.jsonl", [[True], [False], [True]], policy=FULL))
    assert one.ci_method == "Wilson" and one.ci == pytest.approx(rp.accuracy_ci(2, 3))
    assert one.compression == 1.0 and list(one.pass_at_k) == [1]


# ---------------------------------------------------------------------------------------------


@pytest.fixture
def three_runs(tmp_path):
    rng = np.random.default_rng(1)
    base = rng.random((30, 2))
    full = outcomes_run(tmp_path / "full.jsonl", (base < 0.8).tolist(), n=2, policy=FULL)
    rand = outcomes_run(tmp_path / "random1024.jsonl", (base < 0.6).tolist(), n=2)
    small = outcomes_run(tmp_path / "random256.jsonl", (base < 0.3).tolist(), n=2, policy={**RANDOM, "budget": 256})
    return [full, rand, small]


def test_report_markdown_and_plots(three_runs, tmp_path):
    out = tmp_path / "plots"
    text = rp.report(three_runs, out_dir=out)
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith(("| full ", "| random"))]
    assert len(rows) == 3 + 3  # three run rows, three paired rows (every pair: same dataset and model)
    full_row = next(line for line in lines if line.startswith("| full | gsm8k | tiny | full | 2 | 30 | 60 |"))
    assert "bootstrap (problems)" in full_row and "| 1.00 |" in full_row
    assert any(line.startswith("| random1024 | gsm8k | tiny | random (T=1024) |") for line in lines)
    assert "pass@1 %" in text and "pass@2 %" in text and "correct/h" in text and "## Paired comparisons" in text
    assert any(line.startswith("| full | random256 | gsm8k | 30 |") for line in lines)
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["accuracy_vs_compression_gsm8k.png", "policies_gsm8k.png"]
    for p in pngs:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({p.name})" in text
    assert rp.report(three_runs, out_dir=out) == text  # deterministic
    assert "Paired" not in rp.report(three_runs, paired=False)


def test_report_lists_runs_that_cannot_be_paired(three_runs, tmp_path):
    other = outcomes_run(tmp_path / "fewer.jsonl", [[True, True]] * 10, n=2, policy={**RANDOM, "budget": 64})
    text = rp.report([three_runs[0], other])
    assert "full vs fewer: not paired" in text and "same problems" in text
    assert "| A | B |" not in text  # no table without a comparable pair
    elsewhere = outcomes_run(tmp_path / "other_model.jsonl", [[True, True]] * 30, n=2, model="big")
    assert "Paired comparisons" not in rp.report([three_runs[0], elsewhere])  # different models: no pairs


def test_report_refuses_overlapping_or_inconsistent_runs(three_runs, tmp_path):
    with pytest.raises(rp.ReportError, match="given twice"):
        rp.report([three_runs[0], three_runs[1], three_runs[0]])
    copy = tmp_path / "copy.jsonl"
    shutil.copy(three_runs[1], copy)
    with pytest.raises(rp.ReportError, match="same configuration"):
        rp.report([three_runs[1], copy])
    mixed = write_run(tmp_path / "mixed.jsonl", config(), [sample(0, 0, True), sample(1, 0, True, dataset="math500")])
    with pytest.raises(rp.ReportError, match="math500"):
        rp.report([mixed])
    dup = write_run(tmp_path / "dup.jsonl", config(), [sample(0, 0, True), sample(0, 0, False)])
    with pytest.raises(rp.ReportError, match="appears twice"):
        rp.report([dup])
    empty = write_run(tmp_path / "empty.jsonl", config(), [])
    with pytest.raises(rp.ReportError, match="no finished samples"):
        rp.report([empty])
    with pytest.raises(rp.ReportError, match="no run files"):
        rp.report([])


def test_main(three_runs, tmp_path, capsys):
    assert rp.main([str(p) for p in three_runs[:2]] + ["--out-dir", str(tmp_path / "p")]) == 0
    assert "| random1024 |" in capsys.readouterr().out
    assert (tmp_path / "p" / "report.md").read_text().startswith("# randkv report")
    assert rp.main([str(three_runs[0]), str(three_runs[0])]) == 2
    assert "given twice" in capsys.readouterr().err
    assert read_run(three_runs[0]).samples  # the inputs are only read
    assert math.isfinite(rp.summarize(three_runs[0]).correct_per_hour)


def harness_config(problems, n, policy=RANDOM, sha="ab" * 32):
    """The config shape `randkv eval` writes: the dataset as a dict, the model by path."""
    return {"model": {"path": "/models/SmolLM2-135M-Instruct", "architecture": "llama", "dtype": "bfloat16"},
            "dataset": {"name": "aime24", "path": "/data/aime24.jsonl", "sha256": sha, "problems": problems},
            "policy": dict(policy), "samples": n, "max_new_tokens": 512, "grader": "math-verify", "seed": 0,
            "engine": {"slots": 8}}


def harness_samples(problems, n, policy, correct):
    return [sample(i, j, correct(i, j), dataset="aime24", policy=policy, completed_at=100.0 + i)
            for i in problems for j in range(n)]


def test_runs_in_the_harness_format(tmp_path):
    problems = list(range(6))
    partial = write_run(tmp_path / "partial.jsonl", harness_config(problems, 2),
                        harness_samples(problems[:4], 2, "random", lambda i, j: i % 2 == 0), sessions=(50.0,))
    s = rp.summarize(partial)
    assert (s.dataset, s.model, s.trials, s.expected) == ("aime24", "SmolLM2-135M-Instruct", 8, 12)
    assert rp.wall_seconds(partial) == pytest.approx(103.0 - 50.0)
    stray = write_run(tmp_path / "stray.jsonl", harness_config(problems[:2], 2),
                      harness_samples(problems[:3], 2, "random", lambda i, j: True))
    with pytest.raises(rp.ReportError, match="not in the dataset"):
        rp.summarize(stray)
    full = write_run(tmp_path / "full.jsonl", harness_config(problems, 2, FULL),
                     harness_samples(problems[:4], 2, "full", lambda i, j: True), sessions=(50.0,))
    out = tmp_path / "out"
    text = rp.report([full, partial], out_dir=out)
    assert "| partial | aime24 | SmolLM2-135M-Instruct | random (T=1024) | 2 | 4 | 8 of 12 |" in text
    assert "| full | partial | aime24 | 4 |" in text
    assert (out / "report.md").read_text() == text
    other = write_run(tmp_path / "other.jsonl", harness_config(problems, 2, FULL, sha="cd" * 32),
                      harness_samples(problems[:4], 2, "full", lambda i, j: True), sessions=(50.0,))
    with pytest.raises(rp.ReportError, match="different versions of dataset"):
        rp.paired_comparison(partial, other)


def test_process_shards_merge_into_one_run_and_incomplete_or_overlapping_sets_are_refused(tmp_path):
    outcomes = [[True], [False], [True], [True], [False]]
    whole = outcomes_run(tmp_path / "whole.jsonl", outcomes)
    shard = lambda i, n, pids, name: write_run(  # noqa: E731
        tmp_path / name, config(shard={"index": i, "count": n}),
        [sample(p, 0, outcomes[p][0], completed_at=float(p + 1)) for p in pids])
    s0, s1 = shard(0, 2, [0, 2, 4], "a.jsonl"), shard(1, 2, [1, 3], "b.jsonl")
    (merged,) = rp.load_runs([s1, s0])
    assert merged.config == read_run(whole).config and merged.hash == read_run(whole).hash
    assert sorted(r["problem_id"] for r in merged.samples) == [0, 1, 2, 3, 4]
    assert rp.summarize(merged).accuracy == rp.summarize(whole).accuracy == 3 / 5
    with pytest.raises(rp.ReportError, match=r"shard\(s\) 1 of 2 missing"):
        rp.load_runs([s0])
    with pytest.raises(rp.ReportError, match="shard 0 of 2 is given twice"):
        rp.load_runs([s0, s1, shard(0, 2, [0], "c.jsonl")])
    with pytest.raises(rp.ReportError, match="overlap: both hold problem 2 sample 0"):
        rp.load_runs([s0, shard(1, 2, [1, 2, 3], "d.jsonl")])
    with pytest.raises(rp.ReportError, match="shard 2 of 3"):
        rp.load_runs([s0, s1, shard(2, 3, [0], "e.jsonl")])
    with pytest.raises(rp.ReportError, match="same configuration"):  # a shard set and the whole run
        rp.load_runs([s0, s1, whole])
