"""The paper's mechanism probes (arXiv 2609.03430 §2; `../shared/reference/algorithms.md` §2).

A probe is one teacher-forced trace run through the decode loop under a policy:

    stub (prefilled) | lead filler | needle box | filler | query | value
                                   ^ the fact          the model must recall it here

Only a short stub (the chat template's user turn) is prefilled; everything else is forced
through the decode path (`Engine(forced_tokens=...)`), so eviction rounds run over it as they do
over a reasoning trace. The filler comes from real text (e.g. MATH500 solutions) screened so that
it never contains the variable or the value. The needle's age is stated in eviction rounds: the
number of rounds it spends as a candidate (out of the window) before the first value token is
predicted (`ProbeLayout.rounds`).

Metrics, per trial, from the forced value tokens:
  - retrieval: every value token is the model's argmax (what greedy decoding would write), with
    Wilson intervals (`randkv_jax.eval.report.accuracy_ci`);
  - LP: the summed log-probability of the value tokens;
  - recall R = sum(LP - LP_del) / sum(LP_kept - LP_del) over trials (`recall`), LP_kept and
    LP_del from the same trials with the needle pinned in every head or in none (`PinnedSpan`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from randkv_jax.rule import EvictionRule

NEEDLES = {
    "planted-fact": ("\nLet {var} = {value}.\n", "\nWait, I need the stored constants now. {var} ="),
    "passcode": ("\nIMPORTANT: the passcode is {value}. Remember it.\n", "\nWhat was the passcode again? The passcode is"),
}
"""kind -> (needle text, query text); the value follows the query as " {value}"."""

VARIABLES = ("zq", "kx", "vb", "jw", "qf", "xm", "pz", "wk", "yb", "gv", "hd", "tn")
BOX = 24  # tokens of the needle box (the paper: 16 for Qwen3): the needle, padded with filler


class ProbeError(ValueError):
    """A probe that cannot be built as asked."""


@dataclasses.dataclass(frozen=True)
class ProbeLayout:
    """One probe trace, in token ids."""

    stub: list[int]
    """The prefilled prompt."""
    forced: list[int]
    """The teacher-forced tokens after it (generated indices 0 .. len - 1)."""
    needle: tuple[int, int]
    """Absolute positions [start, end) of the needle box."""
    value: tuple[int, int]
    """Indices [start, end) into `forced` of the value tokens."""
    rounds: int
    """Eviction rounds the needle spends as a candidate before the value is read."""


def screen(texts: Sequence[str], forbidden: Sequence[str]) -> list[str]:
    """The texts that contain none of the `forbidden` strings (case-insensitive)."""
    bad = [f.lower() for f in forbidden]
    return [t for t in texts if not any(f in t.lower() for f in bad)]


def filler_ids(tokenizer, texts: Sequence[str], forbidden: Sequence[str], length: int, offset: int = 0) -> list[int]:
    """`length` filler token ids from the screened texts (joined by blank lines), starting at the
    `offset`-th text (trials use different offsets), cycling through them if needed."""
    kept = screen(texts, forbidden)
    if not kept:
        raise ProbeError(f"no filler text is free of {list(forbidden)}")
    ids: list[int] = []
    i = offset
    while len(ids) < length:
        ids += tokenizer.encode(kept[i % len(kept)] + "\n\n")
        i += 1
        if i - offset > 10 * len(kept) + length:
            raise ProbeError("the filler texts encode to no tokens")
    return ids[:length]


def first_candidate_round(rule: EvictionRule, needle_end: int) -> int:
    """The generated count of the first round at which a needle ending at generated index
    `needle_end` (exclusive) is out of the window: the smallest multiple of the interval c with
    needle_end - 1 < c - window."""
    return -(-(needle_end + rule.window) // rule.interval) * rule.interval


def layout(
    tokenizer,
    texts: Sequence[str],
    *,
    kind: str,
    var: str,
    value: str,
    rule: EvictionRule,
    rounds: int,
    stub: Sequence[int],
    offset: int = 0,
    box: int = BOX,
) -> ProbeLayout:
    """The trace of one trial whose needle spends exactly `rounds` eviction rounds as a candidate.

    The lead filler is `rule.budget` tokens long, so every round from the needle's first as a
    candidate on is due; the value starts right after the `rounds`-th such round (or, for 0,
    before the first)."""
    if kind not in NEEDLES:
        raise ProbeError(f"unknown probe {kind!r}; choose one of {', '.join(NEEDLES)}")
    if not isinstance(rounds, int) or rounds < 0:
        raise ProbeError(f"rounds must be a non-negative integer, got {rounds!r}")
    needle_text, query_text = (t.format(var=var, value=value) for t in NEEDLES[kind])
    forbidden = [value] + ([var] if kind == "planted-fact" else [])
    needle = tokenizer.encode(needle_text)
    query = tokenizer.encode(query_text)
    answer = tokenizer.encode(" " + value)
    if len(needle) > box:
        raise ProbeError(f"the needle encodes to {len(needle)} tokens, more than the {box}-token box")
    if len(answer) >= rule.interval:
        raise ProbeError("the value must encode to fewer tokens than the interval")
    lead = rule.budget
    box_end = lead + box
    first = first_candidate_round(rule, box_end)
    if rounds == 0:
        value_start = box_end + len(query)
        if value_start > first:
            raise ProbeError("the query does not fit before the needle's first round as a candidate")
    else:
        value_start = first + (rounds - 1) * rule.interval + 1
    gap = value_start - len(query) - box_end
    if gap < 0:
        raise ProbeError("the query is longer than an interval: raise the interval or shorten the query")
    stream = filler_ids(tokenizer, texts, forbidden, lead + (box - len(needle)) + gap, offset)
    pad = stream[lead: lead + box - len(needle)]
    forced = stream[:lead] + needle + pad + stream[lead + len(pad):] + query + answer
    assert len(forced) == value_start + len(answer)
    start = len(stub) + lead
    return ProbeLayout(list(stub), forced, (start, start + box), (value_start, value_start + len(answer)), rounds)


def candidate_rounds(rule: EvictionRule, prompt_len: int, needle_end: int, value_start: int) -> int:
    """Rounds run (by `rule.due`'s definition) at which the needle is a candidate, before the token
    at generated index `value_start` is predicted: a plain enumeration, the check of `layout`."""
    count = 0
    fill = prompt_len
    for generated in range(1, value_start):  # the step writing generated index g - 1 ends at count g
        fill += 1
        if generated % rule.interval == 0 and fill > rule.budget:
            fill = rule.budget
            if needle_end - 1 < generated - rule.window:
                count += 1
    return count


# ---------------------------------------------------------------------------------------------
# metrics


def value_metrics(logprobs: Sequence[float], greedy: Sequence[bool], value: tuple[int, int]) -> tuple[bool, float]:
    """(retrieved, LP) of one trial from a teacher-forced completion: `logprobs[i]` and `greedy[i]`
    are for forced token i + 1 (`engine.Completion`)."""
    span = range(value[0] - 1, value[1] - 1)
    return all(greedy[i] for i in span), float(sum(logprobs[i] for i in span))


def recall(lp: Sequence[float], lp_kept: Sequence[float], lp_deleted: Sequence[float]) -> float:
    """R = sum(LP - LP_del) / sum(LP_kept - LP_del) over trials (1: as if kept, 0: as if deleted)."""
    lp, kept, deleted = (np.asarray(x, np.float64) for x in (lp, lp_kept, lp_deleted))
    if not lp.shape == kept.shape == deleted.shape or lp.ndim != 1 or not len(lp):
        raise ValueError("recall needs three equal-length, non-empty lists of log-probabilities")
    denominator = float(np.sum(kept - deleted))
    if denominator == 0:
        raise ValueError("LP_kept equals LP_del: the needle makes no difference, recall is undefined")
    return float(np.sum(lp - deleted)) / denominator


def recall_interval(lp, lp_kept, lp_deleted, level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """A bootstrap interval of `recall` over trials (trials resampled together)."""
    lp, kept, deleted = (np.asarray(x, np.float64) for x in (lp, lp_kept, lp_deleted))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(lp), size=(resamples, len(lp)))
    num = (lp[idx] - deleted[idx]).sum(1)
    den = (kept[idx] - deleted[idx]).sum(1)
    values = num[den != 0] / den[den != 0]
    low, high = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


# ---------------------------------------------------------------------------------------------
# running probes


@dataclasses.dataclass(frozen=True)
class Trial:
    """One trial's outcome under one policy."""

    var: str
    value: str
    retrieved: bool
    logprob: float  # summed log p of the value tokens
    evictions: int


def trial_values(trials: int, seed: int) -> list[tuple[str, str, int]]:
    """(variable, 4-digit value, filler offset) of each trial, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    return [(VARIABLES[t % len(VARIABLES)], str(int(rng.integers(1000, 10000))), int(rng.integers(0, 10_000)))
            for t in range(trials)]


def stub_ids(model) -> list[int]:
    """The prefilled stub: the chat template's user turn asking for step-by-step reasoning."""
    return model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Solve the following problems step by step."}])


def run_layouts(model, layouts: Sequence[ProbeLayout], policy, *, slots: int = 8, seed: int = 0,
                seeds: Sequence[int] | None = None) -> list[tuple]:
    """Each layout's (retrieved, LP, evictions) under `policy`, teacher-forced through the engine
    (row seeds: `seeds`, default seed + i for layout i)."""
    seeds = [seed + i for i in range(len(layouts))] if seeds is None else list(seeds)
    from randkv_jax.engine import Engine

    longest = max(len(lay.forced) for lay in layouts)
    engine = Engine(model, policy=policy, slots=slots, max_prompt_tokens=max(len(lay.stub) for lay in layouts),
                    max_new_tokens=longest, chunk=64, forced_tokens=longest)
    ids = [engine.submit(lay.stub, max_new_tokens=len(lay.forced), forced=lay.forced, seed=s,
                         ignore_eos=True, chat=False)[0] for s, lay in zip(seeds, layouts)]
    done = {c.request_id: c for c in engine.run()}
    out = []
    for rid, lay in zip(ids, layouts):
        c = done[rid]
        retrieved, lp = value_metrics(c.logprobs, c.greedy, lay.value)
        out.append((retrieved, lp, c.stats.evictions))
    return out


def _summary(rows: Sequence[tuple], kept: Sequence[tuple] | None, deleted: Sequence[tuple] | None) -> dict:
    from randkv_jax.eval.report import accuracy_ci

    hits = sum(r[0] for r in rows)
    out = {"trials": len(rows), "retrieved": hits, "retrieval": hits / len(rows),
           "retrieval_ci": accuracy_ci(hits, len(rows)), "mean_logprob": float(np.mean([r[1] for r in rows])),
           "evictions": int(np.median([r[2] for r in rows]))}
    if kept is not None and deleted is not None:
        lp, lk, ld = ([r[1] for r in x] for x in (rows, kept, deleted))
        try:
            out["recall"], out["recall_ci"] = recall(lp, lk, ld), recall_interval(lp, lk, ld)
        except ValueError:
            out["recall"] = out["recall_ci"] = None
    return out


def planted_fact(model, texts, base, *, rounds: int, trials: int, head_counts: Sequence[int] | None = None,
                 seed: int = 0, slots: int = 8) -> dict:
    """Retrieval and recall with the needle pinned in n KV heads (all layers), for each n of
    `head_counts` (default 0 .. all). The n-head sets are all combinations, dealt to trials in turn;
    kept / deleted references pin it in every head / in none, on the same trials."""
    import itertools

    kv = model.config.num_kv_heads
    counts = list(range(kv + 1)) if head_counts is None else list(head_counts)
    stub = stub_ids(model)
    lays = [layout(model.tokenizer, texts, kind="planted-fact", var=var, value=value, rule=base.rule, rounds=rounds,
                   stub=stub, offset=off) for var, value, off in trial_values(trials, seed)]
    span = lays[0].needle
    from randkv_jax.policies.pinned import PinnedSpan

    def pinned(heads, idx):  # trial i keeps its row seed whatever subset it runs in
        return run_layouts(model, [lays[i] for i in idx], PinnedSpan(base, *span, tuple(heads)), slots=slots,
                           seeds=[seed + i for i in idx])

    everyone = list(range(trials))
    kept, deleted = pinned(range(kv), everyone), pinned((), everyone)
    result = {"kind": "planted-fact", "policy": repr(base), "rounds": rounds, "trials": trials,
              "forced_tokens": len(lays[0].forced), "by_heads": {}, "by_set": {}}
    for n in counts:
        sets = list(itertools.combinations(range(kv), n))
        rows: list = [None] * trials
        for j, heads in enumerate(sets):
            idx = list(range(j, trials, len(sets)))
            if not idx:
                continue
            outcome = kept if n == kv else deleted if n == 0 else pinned(heads, idx)
            outcome = [outcome[i] for i in idx] if n in (0, kv) else outcome
            for i, r in zip(idx, outcome):
                rows[i] = r
            result["by_set"][",".join(map(str, heads)) or "none"] = _summary(
                outcome, [kept[i] for i in idx], [deleted[i] for i in idx])
        result["by_heads"][n] = _summary(rows, kept, deleted)
    result["unpinned"] = _summary(run_layouts(model, lays, base, slots=slots, seed=seed), kept, deleted)
    from randkv_jax.policies import FullAttention

    result["no_eviction"] = _summary(run_layouts(model, lays, FullAttention(), slots=slots, seed=seed), None, None)
    return result


def passcode(model, texts, policies: dict, *, rounds: int, trials: int, seed: int = 0, slots: int = 8) -> dict:
    """Retrieval and mean log p of a once-stated passcode `rounds` eviction rounds old, per policy
    (name -> policy; a FullAttention entry is the no-eviction reference). The layout follows the
    first eviction policy's rule."""
    rule = next(p.rule for p in policies.values() if hasattr(p, "rule"))
    stub = stub_ids(model)
    lays = [layout(model.tokenizer, texts, kind="passcode", var=var, value=value, rule=rule, rounds=rounds,
                   stub=stub, offset=off) for var, value, off in trial_values(trials, seed)]
    return {"kind": "passcode", "rounds": rounds, "trials": trials, "rule": dataclasses.asdict(rule),
            "forced_tokens": len(lays[0].forced),
            "by_policy": {name: _summary(run_layouts(model, lays, p, slots=slots, seed=seed), None, None)
                          for name, p in policies.items()}}


def teacher_forced_loss(model, texts, policy, *, tokens: int, trials: int, skip: int, seed: int = 0,
                        slots: int = 8) -> dict:
    """Mean negative log-likelihood per token of real text (`tokens` forced tokens of the filler
    texts per trial, after the stub) under `policy`, over the tokens after the first `skip`."""
    stub = stub_ids(model)
    rng = np.random.default_rng(seed)
    streams = [filler_ids(model.tokenizer, texts, [], tokens, int(rng.integers(0, 10_000))) for _ in range(trials)]
    from randkv_jax.engine import Engine

    engine = Engine(model, policy=policy, slots=slots, max_prompt_tokens=len(stub), max_new_tokens=tokens, chunk=64,
                    forced_tokens=tokens)
    ids = [engine.submit(stub, max_new_tokens=tokens, forced=forced, seed=seed + i, ignore_eos=True, chat=False)[0]
           for i, forced in enumerate(streams)]
    done = {c.request_id: c for c in engine.run()}
    per_trial = [-float(np.mean(done[i].logprobs[skip:])) for i in ids]  # the same texts for every policy
    return {**_mean_ci(per_trial, "nll"), "per_trial": per_trial, "trials": trials, "tokens": tokens, "skip": skip}


def _mean_ci(values: Sequence[float], name: str) -> dict:
    """{name: mean, name_ci: normal 95% interval of the mean} over trials."""
    mean = float(np.mean(values))
    half = 1.96 * float(np.std(values, ddof=1)) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return {name: mean, f"{name}_ci": (mean - half, mean + half)}


def block_size(model, texts, base, *, blocks: Sequence[int], tokens: int, trials: int, seed: int = 0,
               slots: int = 8) -> dict:
    """Teacher-forced NLL of real text under Random Attention drawing one score per block of B
    consecutive slots (`slots_per_draw`), for each B, beside full attention on the same texts
    (`nll_vs_full`: the paired difference, with its interval); scored over the tokens after the
    first round."""
    from randkv_jax.policies import FullAttention

    skip = base.budget
    run = lambda policy: teacher_forced_loss(model, texts, policy, tokens=tokens, trials=trials, skip=skip,  # noqa: E731
                                             seed=seed, slots=slots)
    full = run(FullAttention())
    by_block = {}
    for b in blocks:
        result = run(dataclasses.replace(base, slots_per_draw=b))
        paired = np.asarray(result["per_trial"]) - np.asarray(full["per_trial"])  # same texts: paired
        by_block[b] = {**result, **_mean_ci(paired, "nll_vs_full")}
    return {"kind": "block-size", "policy": repr(base), "trials": trials, "tokens": tokens, "by_block": by_block,
            "full": full}


# ---------------------------------------------------------------------------------------------
# survival


def survival(model, texts, policy, *, tokens: int, trials: int, seed: int = 0, slots: int = 8) -> dict:
    """Which generated positions each (layer, row, KV head) holds after every round, on real text
    teacher-forced under `policy` (rounds every `policy.interval` tokens, one per engine chunk).

    Returns, per age n (rounds a position has spent as a candidate; positions that were first
    candidates at a row's first round, which draws from all entries generated until then, are
    left out), the fraction of heads still holding it, against the theory ((K - l_p) / (K - l_p + r))^n (K = K_sel, l_p the pinned
    prompt entries, r the interval), and the cross-head coverage: for positions of each age, the
    distribution of how many KV heads of a layer hold them."""
    from randkv_jax.engine import Engine

    rule = policy.rule
    stub = stub_ids(model)
    rng = np.random.default_rng(seed)
    engine = Engine(model, policy=policy, slots=slots, max_prompt_tokens=len(stub), max_new_tokens=tokens,
                    chunk=rule.interval, forced_tokens=tokens)
    for i in range(trials):
        forced = filler_ids(model.tokenizer, texts, [], tokens, int(rng.integers(0, 10_000)))
        engine.submit(stub, max_new_tokens=tokens, forced=forced, seed=seed + i, ignore_eos=True, chat=False)
    held: dict[int, list[int]] = {}  # age -> [held, total] over (layer, row, head, position)
    coverage: dict[int, np.ndarray] = {}
    kv = model.config.num_kv_heads
    while engine.queued or engine.running:
        slots_before = engine.running_slots  # the rows this chunk runs
        engine.step()
        positions = np.asarray(engine.state.buffer.positions)
        generated = np.asarray(engine.state.buffer.generated)
        for slot in slots_before:
            count = int(generated[slot])
            if count % rule.interval or count <= rule.budget - len(stub):
                continue  # no round ran at the end of this chunk for this row
            p0, n_out = len(stub), count - rule.window  # generated indices [0, n_out) are out of the window
            if n_out <= 0:
                continue
            rows = positions[:, slot] - p0  # [l, k, s] generated index held per slot (< 0: prompt/empty)
            present = np.zeros((*rows.shape[:2], n_out), bool)  # [l, k, generated index]
            li, ki, si = np.nonzero((rows >= 0) & (rows < n_out))
            present[li, ki, rows[li, ki, si]] = True
            index = np.arange(n_out)
            first_due = -(-(rule.budget - p0 + 1) // rule.interval) * rule.interval  # the row's first round
            first = -(-(index + 1 + rule.window) // rule.interval) * rule.interval
            # steady-state cohorts only: the first round draws from every entry generated until then
            ages = np.where(first > first_due, (count - first) // rule.interval + 1, 0)
            heads_holding = present.sum(axis=1)  # [l, n_out]
            for age in np.unique(ages[ages > 0]):
                cols = ages == age
                h = held.setdefault(int(age), [0, 0])
                h[0] += int(present[:, :, cols].sum())
                h[1] += int(present[:, :, cols].size)
                coverage.setdefault(int(age), np.zeros(kv + 1, np.int64))
                coverage[int(age)] += np.bincount(heads_holding[:, cols].ravel(), minlength=kv + 1)
    l_p = min(len(stub), rule.selected - 1) if rule.protect == "prompt" else 0
    keep = (rule.selected - l_p) / (rule.selected - l_p + rule.interval)
    ages = sorted(held)
    return {"kind": "survival", "policy": repr(policy), "trials": trials, "tokens": tokens, "pinned": l_p,
            "ages": ages, "survival": [held[a][0] / held[a][1] for a in ages],
            "theory": [keep**a for a in ages], "observations": [held[a][1] for a in ages],
            "coverage": {a: (coverage[a] / coverage[a].sum()).tolist() for a in ages}}


# ---------------------------------------------------------------------------------------------
# plots


def plot(result: dict, path) -> None:
    """A PNG of one probe result (what `randkv probe --plot` writes)."""
    from randkv_jax.eval.report import figure

    fig = figure()
    ax = fig.add_subplot()
    kind = result["kind"]
    def err(rows):  # asymmetric error bars of the retrieval intervals (>= 0 despite float rounding)
        return np.maximum(0.0, np.array([[r["retrieval"] - r["retrieval_ci"][0] for r in rows],
                                          [r["retrieval_ci"][1] - r["retrieval"] for r in rows]]))

    if kind == "survival":
        ax.semilogy(result["ages"], result["survival"], "o", label="measured (all layers, rows, heads)")
        ax.semilogy(result["ages"], result["theory"], "-", label="((K - l_p) / (K - l_p + r))^n")
        ax.set_xlabel("age n (rounds as a candidate)")
        ax.set_ylabel("P(a head still holds the entry)")
    elif kind == "planted-fact":
        counts = sorted(result["by_heads"], key=int)
        rows = [result["by_heads"][n] for n in counts]
        ax.bar([str(n) for n in counts], [r["retrieval"] for r in rows], yerr=err(rows), capsize=4)
        ax.set_xlabel("KV heads holding the needle (all layers)")
        ax.set_ylabel("greedy retrieval")
    elif kind == "passcode":
        names = list(result["by_policy"])
        rows = [result["by_policy"][n] for n in names]
        ax.bar(names, [r["retrieval"] for r in rows], yerr=err(rows), capsize=4)
        ax.set_ylabel(f"passcode retrieval after {result['rounds']} rounds")
    elif kind == "block-size":
        blocks = [int(b) for b in result["by_block"]]
        rows = list(result["by_block"].values())
        ax.errorbar(blocks, [r["nll_vs_full"] for r in rows],
                    yerr=[r["nll_vs_full"] - r["nll_vs_full_ci"][0] for r in rows], fmt="o-", capsize=4,
                    label="Random Attention, one draw per block of B slots")
        ax.axhline(0.0, color="gray", ls="--", label="full attention")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("slots per draw B")
        ax.set_ylabel("NLL per token minus full attention's (paired)")
    else:
        raise ValueError(f"no plot for probe kind {kind!r}")
    ax.set_title(f"{kind} ({result.get('trials', '?')} trials)")
    if kind in ("survival", "block-size"):
        ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))
