"""`randkv bench`: its accounting against hand-computed values, and one end-to-end run on a tiny
random-weight config (every arm; figures are not asserted, only their structure and invariants)."""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import jax
import numpy as np
import pytest

from randkv_jax import policies
from randkv_jax.cli import main
from randkv_jax.eval import bench
from tests.hf_tiny import save_tiny


def test_mean_fill_follows_the_loop_schedule():
    # P=8, T=24, w=i=8, 40 generated (39 decode steps): the fill after each step's append is
    # 9..32 for steps 1-24 (the round after step 24 leaves 24), 25..32 for steps 25-32, 25..31 after.
    policy = policies.RandomAttention(budget=24, window=8)
    expected = (sum(range(9, 33)) + sum(range(25, 33)) + sum(range(25, 32))) / 39
    assert bench.mean_fill(policy, 8, 40) == pytest.approx(expected)
    assert bench.mean_fill(policies.FullAttention(), 8, 40) == pytest.approx(np.mean(np.arange(9, 48)))


def test_runs_interleave_in_alternating_order():
    a, b = (bench.Arm(n, None, [[1]], 4, 128) for n in "ab")
    c = bench.dataclasses.replace(bench.Arm("c", None, [[1]], 4, 128), runs_per_repeat=2)
    order = [(arm.name, first) for arm, first in bench.interleaved([a, b, c], 3)]
    assert [n for n, _ in order] == list("abcc" "ccba" "abcc")
    assert [n for n, first in order if first] == list("abc")  # each arm's first run keeps its state


def test_the_overhead_reference_spans_the_compared_arm_steps(tmp_path):
    save_tiny("llama", tmp_path)
    model, _ = bench.bench_model(str(tmp_path), None, "float32")
    short = bench.full_at_fill(model, 40.0, 8, 2, 128, steps_to_match=39)
    long = bench.full_at_fill(model, 40.0, 8, 2, 128, steps_to_match=4095)
    assert (short.gen, len(short.prompts[0]), short.runs_per_repeat) == (17, 32, 5)  # at least 5 runs
    assert long.runs_per_repeat * 2 * 8 >= 4095 > (long.runs_per_repeat - 1) * 2 * 8


def test_read_bandwidth_is_a_positive_rate():
    assert bench.read_bandwidth(gib=1 / 64, repeats=2) > 1e8  # more than 0.1 GB/s on any machine


def test_weight_bytes_count_an_untied_embedding_once(tmp_path):
    for name in ("llama", "qwen3_untied"):  # tied, untied
        save_tiny(name, tmp_path / name)
        model, _ = bench.bench_model(str(tmp_path / name), None, "float32")
        total = sum(x.nbytes for x in jax.tree.leaves(model.params))
        embed = model.params["embed"]["embedding"].nbytes
        assert bench.weight_bytes_per_step(model) == (total if model.config.tie_word_embeddings else total - embed)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", directory)
    return directory / "config.json"


def test_bench_end_to_end_on_random_weights(tiny_config, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--config", str(tiny_config), "--dtype", "float32", "--batch", "2", "--prompt", "8",
                 "--gen", "40", "--budget", "24", "--window", "8", "--interval", "8", "--repeats", "3",
                 "--hf-gen", "8", "--hf-steps", "6", "--requests", "3", "--serving-max-len", "24", "--out", str(out), "--json", "--quiet"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    stored = json.loads((out / "bench.json").read_text())
    assert printed == stored
    assert (out / "bench.md").read_text().startswith("config.json (random weights)")
    assert (out / "bench.png").stat().st_size > 0
    for key in ("random_vs_full", "random_vs_triattention", "random_vs_best_scorer", "eviction_overhead", "jax_vs_hf"):
        assert stored[key] > 0, key
    runs = stored["policies"]
    assert list(runs) == ["full", "random", "snapkv", "rkv", "vase", "triattention"]
    evicting = [r for name, r in runs.items() if name != "full"]
    # budget parity: every eviction policy runs the same rounds and holds the same entries
    assert len({(r["rounds"], r["kv_bytes_held"], r["kv_bytes_allocated"]) for r in evicting}) == 1
    assert evicting[0]["rounds"] == 2  # 39 decode steps: rounds after generated 24 and 32 (see mean_fill's test)
    assert all(len(r["repeats"]) == 3 and r["ms_per_round"] > 0 for r in evicting)
    assert runs["full"]["kv_bytes_held"] > evicting[0]["kv_bytes_held"]
    slot = 2 * 2 * 2 * 16 * 4  # keys and values x layers x KV heads x head dim x float32 bytes (tiny llama)
    for r in runs.values():  # parameters + the mean KV entries of both rows
        assert r["bytes_per_step"] == pytest.approx(stored["weight_bytes_per_step"] + r["mean_fill"] * slot * 2)
    # the bandwidth probed before the timed runs and after each of the 3 interleaving rounds, the highest counting
    probes = stored["read_bandwidth_probes"]
    assert len(probes) == 4 and stored["read_bandwidth"] == max(probes)
    for r in runs.values():
        assert r["bandwidth_fraction"] == pytest.approx(r["achieved_bytes_per_second"] / max(probes))
    assert stored["random_vs_full_bytes_bound"] == pytest.approx(
        runs["full"]["bytes_per_step"] / runs["random"]["bytes_per_step"])
    assert stored["hf"]["tokens_equal_full"] is True and stored["hf"]["gen"] == 8
    # transformers at the run's 40 generated, timed on 6 steps: static over 8 + 40 slots, dynamic
    # around the mean length (8 + 40 / 2, less half the steps)
    at_gen = stored["hf_at_gen"]
    assert (at_gen["gen"], at_gen["steps"], at_gen["dynamic_prompt"]) == (40, 6, 25)
    assert at_gen["tokens_per_second"] == max(at_gen["static_tokens_per_second"], at_gen["dynamic_tokens_per_second"])
    assert stored["random_vs_hf"] == pytest.approx(runs["random"]["tokens_per_second"] / at_gen["tokens_per_second"])
    reference = stored["references"]["full_at_random_fill"]
    assert reference["mean_fill"] == pytest.approx(runs["random"]["mean_fill"], abs=1)
    assert len(reference["repeats"]) == 3 * 5  # the short reference runs 5 times per interleaving round
    assert {r["policy"] for r in stored["equal_memory"]["runs"]} == {"full", "random", "triattention"}
    assert all(0 < r["bandwidth_fraction"] for r in stored["equal_memory"]["runs"] if r["batch"])
    assert all(r["useful_tokens"] > 0 for r in stored["serving"])


def test_bench_hf_arm_without_a_full_policy(tiny_config, tmp_path, capsys):
    """transformers is compared with a FullAttention run at its length even when only Random is timed."""
    code = main(["bench", "--config", str(tiny_config), "--dtype", "float32", "--batch", "2", "--prompt", "8",
                 "--gen", "16", "--budget", "16", "--window", "4", "--interval", "4", "--policies", "random",
                 "--no-memory", "--requests", "0", "--json", "--quiet"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["policies"]) == ["random"] and result["random_vs_full"] is None
    assert result["references"]["full_at_hf_gen"]["steps"] == 15 and result["hf"]["tokens_equal_full"] is True
    assert result["jax_vs_hf"] > 0 and result["random_vs_hf"] > 0 and "hf_at_gen" not in result


@pytest.mark.parametrize("flags, named", [(["--repeats", "2"], "repeats=2"), (["--hf-steps", "1"], "hf_steps=1"),
                                          (["--gen", "0", "--hf-gen", "1"], "gen=0, hf_gen=1")])
def test_bench_refuses_settings_it_cannot_measure(flags, named, capsys):
    """Refused before the model loads or anything is timed."""
    assert main(["bench", "--config", "no-such-model", "--quiet", *flags]) == 2
    assert named in capsys.readouterr().err


def test_bench_refuses_an_unknown_config(capsys):
    assert main(["bench", "--config", "no-such-model", "--quiet"]) == 2
    assert "no config 'no-such-model'" in capsys.readouterr().err
