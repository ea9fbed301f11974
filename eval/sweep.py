"""`randkv sweep CONFIG.toml`: models x policies x budgets x datasets, one run file each, finished runs skipped.

    out_dir = "runs"
    limit = 50                  # optional: the first N problems of each dataset
    samples = 2                 # optional: else each dataset's preset
    max_new_tokens = 32768      # optional
    seed = 0                    # optional
    slots = 8                   # optional
    models = ["path/to/Qwen3-4B"]          # "default": the embedded SmolLM2
    datasets = ["math500", "../shared/data/aime25.jsonl"]

    [[policies]]
    name = "random"
    budgets = [1024, 2048]      # optional: else the dataset's preset budget
    [[policies]]
    name = "full"

Each cell goes to `out_dir/<model>__<dataset>__<policy>[-<budget>].jsonl`. A cell whose run file
already holds every (problem, sample) of its configuration is skipped without loading anything;
an unfinished one is resumed (and refused, by `records.RunWriter`, if its configuration changed).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from randkv_jax.eval.records import RunFileError, read_run

KEYS = {"out_dir", "limit", "samples", "max_new_tokens", "seed", "slots", "models", "datasets", "policies", "dtype"}


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str  # a path, or "default"
    dataset: str
    policy: str
    budget: int | None  # None: the dataset's preset (or no budget: full attention)
    options: dict  # the policy's other fields
    out: Path


def _tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", Path(text).stem if "/" in text or text.endswith(".jsonl") else text)


def read_sweep(path: str | Path) -> tuple[dict, list[Cell]]:
    """The sweep's shared settings and its cells, in order."""
    path = Path(path)
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the sweep file: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not a TOML file: {e}") from None
    unknown = set(spec) - KEYS
    if unknown:
        raise ValueError(f"{path}: unknown settings {', '.join(sorted(unknown))} (known: {', '.join(sorted(KEYS))})")
    for key in ("models", "datasets", "policies"):
        if not spec.get(key):
            raise ValueError(f"{path}: `{key}` must be a non-empty list")
    out_dir = path.parent / spec.get("out_dir", "runs")
    cells = []
    for model in spec["models"]:
        for dataset in spec["datasets"]:
            for entry in spec["policies"]:
                if "name" not in entry:
                    raise ValueError(f"{path}: a [[policies]] entry without a name")
                options = {k: v for k, v in entry.items() if k not in ("name", "budgets")}
                for budget in entry.get("budgets", [None]):
                    suffix = "" if budget is None else f"-{budget}"
                    out = out_dir / f"{_tag(model)}__{_tag(dataset)}__{entry['name']}{suffix}.jsonl"
                    cells.append(Cell(model, dataset, entry["name"], budget, options, out))
    shared = {k: spec[k] for k in ("limit", "samples", "max_new_tokens", "seed", "slots", "dtype") if k in spec}
    return shared, cells


def finished(cell: Cell) -> bool:
    """Whether the cell's run file holds every (problem, sample) its configuration asks for."""
    if not cell.out.exists():
        return False
    try:
        run = read_run(cell.out)
    except RunFileError:
        return False  # resuming will say what is wrong
    wanted = {(p, j) for p in run.config["dataset"]["problems"] for j in range(run.config["samples"])}
    return wanted <= run.done()


def run_sweep(path: str | Path, run_cell: Any, dry_run: bool = False) -> list[tuple[Cell, str]]:
    """Run every unfinished cell with `run_cell(cell, shared)`; returns (cell, "skipped" | "ran" | "planned")."""
    shared, cells = read_sweep(path)
    outcome = []
    for cell in cells:
        if finished(cell):
            outcome.append((cell, "skipped"))
        elif dry_run:
            outcome.append((cell, "planned"))
        else:
            run_cell(cell, shared)
            outcome.append((cell, "ran"))
    return outcome
