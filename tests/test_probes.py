"""The probes' building blocks: needle layout and age in rounds, filler screening, head pinning
in the decode loop, and the recall metric against a plain computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from randkv_jax.engine import Engine
from randkv_jax.eval import probes
from randkv_jax.policies import RandomAttention, SnapKV
from randkv_jax.policies.pinned import PinnedSpan
from randkv_jax.rule import EvictionRule

MATH500 = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500.jsonl"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from randkv_jax.models.loading import default_model_dir
    from randkv_jax.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def solutions():
    if not MATH500.exists():
        pytest.skip(f"{MATH500} is absent (the shared eval data sits beside the checkout)")
    return [json.loads(line)["solution"] for line in MATH500.read_text().splitlines()[:60]]


@pytest.mark.parametrize("budget,window,interval", [(128, 32, 32), (96, 16, 32), (160, 64, 16)])
@pytest.mark.parametrize("rounds", [0, 1, 3, 7])
def test_needle_age_is_the_intended_number_of_rounds(smollm2_tokenizer, solutions, budget, window, interval, rounds):
    rule = EvictionRule(budget, window, interval)
    stub = smollm2_tokenizer.encode("Solve it.")
    try:
        lay = probes.layout(smollm2_tokenizer, solutions, kind="planted-fact", var="zq", value="4821", rule=rule,
                            rounds=rounds, stub=stub)
    except probes.ProbeError as e:  # the query cannot fit before the first candidate round
        assert rounds == 0 and "does not fit" in str(e)
        return
    needle_end = lay.needle[1] - len(stub)  # generated index one past the box
    assert probes.candidate_rounds(rule, len(stub), needle_end, lay.value[0]) == rounds
    text = smollm2_tokenizer.decode(lay.forced[lay.value[0]:lay.value[1]])
    assert text == " 4821"
    needle = smollm2_tokenizer.decode(lay.forced[lay.needle[0] - len(stub): lay.needle[1] - len(stub)])
    assert needle.startswith("\nLet zq = 4821.\n")


def test_filler_never_contains_the_variable_or_the_value(smollm2_tokenizer, solutions):
    texts = [*solutions, "so zq is the unknown", "the code 4821 appears", "ZQ in capitals"]
    kept = probes.screen(texts, ["zq", "4821"])
    assert len(kept) < len(texts) and all("zq" not in t.lower() and "4821" not in t for t in kept)
    for offset in range(0, 40, 7):
        ids = probes.filler_ids(smollm2_tokenizer, texts, ["zq", "4821"], 3000, offset)
        text = smollm2_tokenizer.decode(ids)
        assert len(ids) == 3000 and "zq" not in text.lower() and "4821" not in text
    with pytest.raises(probes.ProbeError, match="free of"):
        probes.filler_ids(smollm2_tokenizer, ["zq"], ["zq"], 10)


def _pinned_run(model, base, heads):
    rng = np.random.default_rng(1)
    prompt, forced = rng.integers(3, 256, size=6).tolist(), rng.integers(3, 256, size=150).tolist()
    start = len(prompt) + 70  # needle at generated 70 .. 79: out of the window from count 88 on
    policy = PinnedSpan(base, start, start + 10, heads)
    engine = Engine(model, policy=policy, slots=2, max_prompt_tokens=8, max_new_tokens=160, chunk=8,
                    forced_tokens=160)
    for seed in (0, 1):
        engine.submit(prompt, max_new_tokens=len(forced), forced=forced, seed=seed, ignore_eos=True, chat=False)
    done = list(engine.run())
    assert all(c.stats.evictions > 5 for c in done)
    return np.asarray(engine.state.buffer.positions), (start, start + 10)


@pytest.mark.parametrize("base", [RandomAttention(budget=48, window=8, interval=8),
                                  SnapKV(budget=48, window=8, interval=8)], ids=["random", "snapkv"])
@pytest.mark.parametrize("heads", [(), (1,), (0, 1)])
def test_pinning_puts_the_needle_exactly_in_the_chosen_heads(tiny_model, base, heads):
    positions, (start, end) = _pinned_run(tiny_model, base, heads)
    layers, rows, kv_heads, _ = positions.shape
    for layer in range(layers):
        for row in range(rows):
            for head in range(kv_heads):
                held = set(positions[layer, row, head].tolist()) & set(range(start, end))
                assert held == (set(range(start, end)) if head in heads else set()), (layer, row, head)


def test_pinning_checks_its_span_and_heads(tiny_model):
    base = RandomAttention(budget=48, window=8, interval=8)
    with pytest.raises(ValueError, match="does not fit the selected part"):
        PinnedSpan(base, 10, 60, (0,))
    with pytest.raises(ValueError, match="0 <= start < end"):
        PinnedSpan(base, 10, 10, (0,))
    with pytest.raises(ValueError, match=r"pinned heads \[2\] do not exist"):
        PinnedSpan(base, 10, 20, (2,)).check_model(tiny_model.config)


def test_recall_equals_a_plain_computation():
    rng = np.random.default_rng(0)
    deleted = -rng.uniform(5, 15, size=50)
    kept = -rng.uniform(0, 2, size=50)
    lp = deleted + rng.uniform(0, 1, size=50) * (kept - deleted)
    want = math.fsum(a - d for a, d in zip(lp, deleted)) / math.fsum(k - d for k, d in zip(kept, deleted))
    assert probes.recall(lp, kept, deleted) == pytest.approx(want, rel=1e-12)
    assert probes.recall(kept, kept, deleted) == pytest.approx(1.0) and probes.recall(deleted, kept, deleted) == 0.0
    low, high = probes.recall_interval(lp, kept, deleted)
    assert low < want < high
    with pytest.raises(ValueError, match="undefined"):
        probes.recall(lp, deleted, deleted)
    with pytest.raises(ValueError, match="equal-length"):
        probes.recall(lp[:3], kept, deleted)


def test_value_metrics_read_the_value_tokens():
    # logprobs[i] / greedy[i] are for forced token i + 1; the value is tokens 4 .. 6
    logprobs = [-9.0, -9.0, -9.0, -0.5, -0.25, -9.0]
    assert probes.value_metrics(logprobs, [False, False, False, True, True, False], (4, 6)) == (True, -0.75)
    assert probes.value_metrics(logprobs, [True, True, True, True, False, True], (4, 6))[0] is False


@pytest.fixture(scope="module")
def smollm2():
    import randkv_jax

    return randkv_jax.load_model(None, dtype="float32")


@pytest.mark.slow
def test_smollm2_retrieves_the_planted_value_without_eviction(smollm2, solutions):
    """The probe format works before any eviction result means anything: >= 90% greedy retrieval
    under full attention, at the needle age the recorded probes use (8 rounds of T=128, r=16)."""
    from randkv_jax.policies import FullAttention

    rule = EvictionRule(128, 16, 16)
    stub = probes.stub_ids(smollm2)
    lays = [probes.layout(smollm2.tokenizer, solutions, kind=kind, var=var, value=value, rule=rule, rounds=8,
                          stub=stub, offset=off)
            for kind in ("planted-fact", "passcode") for var, value, off in probes.trial_values(10, 0)]
    outcomes = probes.run_layouts(smollm2, lays, FullAttention(), slots=10)
    for kind, rows in (("planted-fact", outcomes[:10]), ("passcode", outcomes[10:])):
        assert sum(r[0] for r in rows) >= 9, kind
        assert all(r[2] == 0 for r in rows)


@pytest.mark.slow
def test_survival_follows_the_theory_on_smollm2(smollm2, solutions):
    """Measured survival of generated entries against ((K - l_p) / (K - l_p + r))^n; the old
    K / (K + r) (prompt outside the budget) would sit far above it."""
    policy = RandomAttention(budget=96, window=16, interval=16)
    result = probes.survival(smollm2, solutions, policy, tokens=240, trials=2, slots=2)
    l_p = result["pinned"]
    assert l_p == len(probes.stub_ids(smollm2))
    keep = (80 - l_p) / (80 - l_p + 16)
    for age, measured, theory in zip(result["ages"], result["survival"], result["theory"]):
        if age <= 6:
            assert theory == pytest.approx(keep**age)
            assert abs(measured - theory) < 0.05, (age, measured, theory)
            assert measured < (80 / 96) ** age - 0.05
    assert result["ages"][:6] == [1, 2, 3, 4, 5, 6]
    for age in result["ages"]:
        assert sum(result["coverage"][age]) == pytest.approx(1.0)


def test_probe_cli_refuses_missing_or_empty_filler(tmp_path, capsys):
    from randkv_jax.cli import main

    assert main(["probe", "survival", "--filler", str(tmp_path / "none.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["probe", "survival", "--filler", str(empty)]) == 2
    assert "holds no filler text" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x"}\n')
    assert main(["probe", "survival", "--filler", str(bad)]) == 2
    assert "line 1: no 'solution' or 'text' string" in capsys.readouterr().err


def test_plots_of_every_probe_kind(tmp_path):
    from randkv_jax.eval.report import accuracy_ci

    def row(hits, n=24):
        return {"retrieval": hits / n, "retrieval_ci": accuracy_ci(hits, n)}

    results = [
        {"kind": "survival", "trials": 2, "ages": [1, 2, 3], "survival": [0.8, 0.6, 0.5], "theory": [0.8, 0.64, 0.5]},
        {"kind": "planted-fact", "trials": 24, "by_heads": {"0": row(0), "1": row(2), "3": row(24)}},
        {"kind": "passcode", "trials": 24, "rounds": 8, "by_policy": {"random": row(0), "full": row(24)}},
        {"kind": "block-size", "trials": 8, "by_block": {"1": {"nll_vs_full": 0.02, "nll_vs_full_ci": (0.01, 0.03)}},
         "full": {"nll": 1.8}},
    ]
    for result in results:
        path = tmp_path / f"{result['kind']}.png"
        probes.plot(result, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no plot"):
        probes.plot({"kind": "other"}, tmp_path / "x.png")
