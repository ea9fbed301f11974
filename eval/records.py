"""The run file of `randkv eval`: one JSON object per line, appended and flushed as samples finish.

    {"kind": "config", "hash": H, "config": {...}}       the first line: everything that decides the results
    {"kind": "session", "started": T, ...}                 each (re)start of the run
    {"kind": "sample", "problem_id": ..., "sample": j, ...}  one finished (problem, sample)

Every record is written with its newline in one flushed, fsynced write, so a run killed mid-write
can leave only a torn last line (bytes after the last newline): `read_run` drops it (`torn_bytes`)
and `RunWriter` truncates it before appending, so nothing is mixed in. Any other malformed line is
an error naming the file and line.

A run split over processes (`randkv eval` under `jax.distributed`) writes one file per process,
`shard_path(out, i, n)`, whose configuration says `"shard": {"index": i, "count": n}`;
`merge_shards` joins a complete set back into one run and refuses missing or overlapping shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

SAMPLE_FIELDS = (
    "problem_id", "sample", "seed", "dataset", "policy", "correct", "terminated", "strict_correct", "extracted",
    "gold", "output", "prompt_tokens", "new_tokens", "evictions", "held_after_round", "peak_slots",
    "finish_reason", "completed_at",
)
"""Fields every sample record has (`report` relies on them)."""


class RunFileError(ValueError):
    """A run file that cannot be read or continued."""


def config_hash(config: dict) -> str:
    """sha256 of the configuration's canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclasses.dataclass
class Run:
    path: Path
    config: dict
    hash: str
    sessions: list[dict]
    samples: list[dict]
    torn_bytes: int = 0  # bytes of a torn last line (dropped)
    valid_bytes: int = 0  # bytes up to the end of the last whole line

    def done(self) -> set[tuple[str, int]]:
        """(problem_id, sample) pairs already finished."""
        return {(r["problem_id"], r["sample"]) for r in self.samples}


def read_run(path: str | Path) -> Run:
    """Read a run file; a torn last line is dropped (`torn_bytes`), any other bad line refused."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunFileError(f"{path}: cannot read the run file: {e.strerror or e}") from None
    lines = data.split(b"\n")
    torn = len(lines.pop())  # every record is written with its newline: bytes after the last one are torn
    records = []
    for number, raw in enumerate(lines, start=1):
        try:
            records.append(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RunFileError(f"{path}, line {number}: not a JSON object ({e})") from None
    if not records or records[0].get("kind") != "config" or "hash" not in records[0] or "config" not in records[0]:
        raise RunFileError(f"{path}, line 1: a run file starts with its configuration line")
    config, digest = records[0]["config"], records[0]["hash"]
    if config_hash(config) != digest:
        raise RunFileError(f"{path}, line 1: the configuration does not match its hash (edited?)")
    sessions, samples = [], []
    for number, record in enumerate(records[1:], start=2):
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == "session":
            sessions.append(record)
        elif kind == "sample":
            missing = [f for f in SAMPLE_FIELDS if f not in record]
            if missing:
                raise RunFileError(f"{path}, line {number}: sample record without {', '.join(missing)}")
            samples.append(record)
        else:
            raise RunFileError(f"{path}, line {number}: unknown record kind {kind!r}")
    return Run(path, config, digest, sessions, samples, torn, len(data) - torn)


class RunWriter:
    """Appends records to a run file, each line flushed and fsynced as it is written."""

    def __init__(self, path: str | Path, config: dict):
        self.path = Path(path)
        self.hash = config_hash(config)
        if self.path.exists() and self.path.stat().st_size:
            run = read_run(self.path)
            if run.hash != self.hash:
                changed = sorted(k for k in set(run.config) | set(config) if run.config.get(k) != config.get(k))
                raise RunFileError(
                    f"{self.path} holds a run with another configuration (differs in: {', '.join(changed)}); "
                    f"use another --out to start a new run"
                )
            self.run = run
            with open(self.path, "r+b") as f:  # drop a torn last line before appending
                f.truncate(run.valid_bytes)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.run = None
            self._file = open(self.path, "ab")
            self.write({"kind": "config", "hash": self.hash, "config": config})
            self._file.close()
        self._file = open(self.path, "ab")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write((json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode())
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shard_path(path: str | Path, index: int, count: int) -> Path:
    """The run file of process `index` of `count`: run.jsonl -> run.shard-1-of-2.jsonl."""
    path = Path(path)
    return path.with_name(f"{path.stem}.shard-{index}-of-{count}{path.suffix}")


def _unsharded(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "shard"}


def merge_shards(runs: list[Run]) -> list[Run]:
    """`runs` with every set of shards of one run joined into a single `Run` (in first-seen order).

    A shard set must be complete (indices 0 .. count-1, each once) and its shards disjoint (no
    (problem, sample) in two of them); anything else is refused with the files named."""
    groups: dict[str, list[Run]] = {}
    out: list[Run | str] = []
    for run in runs:
        if "shard" not in run.config:
            out.append(run)
            continue
        key = config_hash(_unsharded(run.config))
        if key not in groups:
            groups[key] = []
            out.append(key)
        groups[key].append(run)
    merged = {}
    for key, shards in groups.items():
        count = shards[0].config["shard"]["count"]
        by_index: dict[int, Run] = {}
        for run in shards:
            index, n = run.config["shard"]["index"], run.config["shard"]["count"]
            if n != count:
                raise RunFileError(f"{run.path} is shard {index} of {n}, {shards[0].path} one of {count}")
            if index in by_index:
                raise RunFileError(f"shard {index} of {count} is given twice: {by_index[index].path} and {run.path}")
            by_index[index] = run
        missing = sorted(set(range(count)) - set(by_index))
        if missing:
            raise RunFileError(f"{shards[0].path}: shard(s) {', '.join(map(str, missing))} of {count} missing; "
                               f"give every process's file ({shard_path('RUN.jsonl', missing[0], count)} ...)")
        owner: dict[tuple[str, int], Path] = {}
        for index in range(count):
            run = by_index[index]
            for pair in run.done():
                if pair in owner:
                    raise RunFileError(f"{run.path} and {owner[pair]} overlap: both hold problem {pair[0]!r} "
                                       f"sample {pair[1]}")
                owner[pair] = run.path
        ordered = [by_index[i] for i in range(count)]
        config = _unsharded(ordered[0].config)
        merged[key] = Run(
            path=Path(f"{ordered[0].path} (+{count - 1} shards)"), config=config, hash=config_hash(config),
            sessions=[s for r in ordered for s in r.sessions], samples=[s for r in ordered for s in r.samples],
        )
    return [merged[x] if isinstance(x, str) else x for x in out]
