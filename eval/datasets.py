"""Evaluation sets: MATH500, AIME 2025/2026, HMMT Feb 2025, GPQA-Diamond and LiveCodeBench as `Problem`s.

    load_dataset("../shared/data/math500.jsonl")        a local file: JSONL (math or LiveCodeBench) or CSV (GPQA)
    load_dataset("math500")                             a registered name: downloaded from the Hugging Face Hub
    load_dataset("gpqa_diamond.csv", limit=20)          the first 20 problems

Layouts read:

* math (JSONL, one object a line): `problem` and `answer` (a string, or an integer as in some AIME copies),
  an id in `id` (the normalized layout of `../shared/data/SOURCES.md`), `unique_id` (MATH-500) or
  `problem_idx` (MathArena), and optionally `source`, `subject`, `level`, `solution`, `problem_type`.
* gpqa (CSV): the official GPQA layout (`gpqa_diamond.csv`): the columns `Question`, `Correct Answer`,
  `Incorrect Answer 1..3` are required, `Record ID`, `High-level domain`, `Subdomain` are used when present.
  Every value is stripped of surrounding whitespace (as the official harnesses do). The four choices are put
  in a fixed order per question: choice i (0 = the correct answer, 1-3 = the incorrect ones in column order)
  is ranked by sha256(f"{key}\\x1f{i}") with key = the Record ID (the question text where a row has none),
  and the choices are listed in increasing order of that digest. The gold letter ("A".."D") is therefore the
  same on every run, machine and Python version, and does not depend on the row's position in the file.
* code (JSONL): LiveCodeBench `code_generation_lite` rows: `question_id`, `question_content`,
  `public_test_cases` (a JSON string of [{"input", "output", "testtype"}]), `private_test_cases` (the same as
  plain JSON in older releases, or base64 of zlib of a pickle of that JSON string) and `metadata` (a JSON
  string, "func_name" for functional problems). The pickle is read by an unpickler that refuses every global,
  so only plain strings, lists, dicts and numbers can come out of it; anything else is a `DatasetError`.

Every error is a `DatasetError` (a `ValueError`) that names the file and, for a bad row, its 1-based line.
`limit` stops reading after that many problems (later rows are not checked).
"""

from __future__ import annotations

import base64
import binascii
import csv
import dataclasses
import hashlib
import io
import json
import os
import pickle
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TASKS = ("math", "gpqa", "code")
SUFFIXES = (".jsonl", ".csv", ".parquet")
CHOICE_LETTERS = "ABCD"
GPQA_REQUIRED = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
TEST_TYPES = ("stdin", "functional")
_MAX_DECODED_BYTES = 1 << 30  # a decompressed private-test payload larger than this is refused


class DatasetError(ValueError):
    """A dataset that cannot be found, read or parsed; the message names the file (and line)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    id: str
    task: str  # "math" | "gpqa" | "code"
    question: str  # the text the prompt is built from (problem statement, GPQA question, LCB question_content)
    answer: str  # gold answer; for gpqa the gold letter "A".."D"; for code ""
    choices: tuple[str, ...] = ()  # gpqa: the four choices in their A-D order
    tests: tuple[tuple[str, str, str], ...] = ()  # code: (input, output, testtype), public tests first
    starter_code: str = ""
    func_name: str | None = None  # code: the function to call for "functional" tests
    metadata: dict = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    path: Path
    sha256: str  # of the file's bytes
    problems: tuple[Problem, ...]
    task: str

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)


@dataclasses.dataclass(frozen=True)
class HubFile:
    repo_id: str  # a Hugging Face dataset repository
    filename: str
    revision: str | None = None  # None: the default branch
    gated: bool = False  # needs accepted terms and a token: not downloaded, the user passes the file


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    name: str
    task: str
    hub: HubFile
    source: str  # the default `source` of a row that has none
    example: str  # what to pass instead when the Hub cannot be used
    fields: str  # how the Hub file's fields map to a Problem
    aliases: tuple[str, ...] = ()


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "math500", "math", HubFile("HuggingFaceH4/MATH-500", "test.jsonl"), "MATH500",
            "../shared/data/math500.jsonl",
            "unique_id -> id, problem, answer; subject, level, solution -> metadata",
            aliases=("math-500",),
        ),
        DatasetInfo(
            "aime2025", "math", HubFile("math-ai/aime25", "test.jsonl"), "AIME 2025",
            "../shared/data/aime25.jsonl", "id, problem, answer",
            aliases=("aime25", "aime-2025"),
        ),
        DatasetInfo(
            "aime2026", "math", HubFile("math-ai/aime26", "aime2026.jsonl"), "AIME 2026",
            "../shared/data/aime26.jsonl", "id (int) -> str, problem, answer",
            aliases=("aime26", "aime-2026"),
        ),
        DatasetInfo(
            "hmmt-feb-2025", "math", HubFile("MathArena/hmmt_feb_2025", "data/train-00000-of-00001.parquet"),
            "HMMT February 2025", "../shared/data/hmmt_feb25.jsonl",
            "problem_idx -> id, problem, answer; problem_type -> metadata (Parquet: needs pyarrow)",
            aliases=("hmmt_feb25", "hmmt-feb25", "hmmt_feb_2025"),
        ),
        DatasetInfo(
            "gpqa-diamond", "gpqa", HubFile("Idavidrein/gpqa", "gpqa_diamond.csv", gated=True), "GPQA Diamond",
            "path/to/gpqa_diamond.csv",
            "Question, Correct Answer, Incorrect Answer 1-3 -> choices (fixed shuffle), Record ID -> id",
            aliases=("gpqa_diamond",),
        ),
        DatasetInfo(
            "livecodebench", "code", HubFile("livecodebench/code_generation_lite", "test6.jsonl"), "LiveCodeBench",
            "path/to/code_generation_lite/test6.jsonl",
            "question_id -> id, question_content -> question, public + private tests, metadata.func_name "
            "(test6.jsonl: the problems added in release_v6; release_vN is test.jsonl + test2..testN.jsonl)",
            aliases=("lcb", "code_generation_lite"),
        ),
    )
}
"""The registered names, each with the Hub file it is downloaded from."""


def _lookup(name: str) -> DatasetInfo | None:
    key = name.strip().lower()
    for info in DATASETS.values():
        if key == info.name or key in info.aliases:
            return info
    return None


def load_dataset(name_or_path: str | os.PathLike, *, task: str | None = None, limit: int | None = None) -> Dataset:
    """Load a registered dataset (from the Hub) or a local .jsonl/.csv file as a `Dataset` of `Problem`s.

    A file's task is `task` when given, else a CSV is GPQA and a JSONL is LiveCodeBench when its first row has
    `question_content`, math when it has `problem`. A registered name downloads its Hub file
    (`huggingface_hub.hf_hub_download`, cached); without the Hub it raises a `DatasetError` that says which
    local file to pass instead.
    """
    if task is not None and task not in TASKS:
        raise DatasetError(f"unknown task {task!r} (expected one of: {', '.join(TASKS)})")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DatasetError(f"limit must be a positive integer, got {limit!r}")
    text = os.fspath(name_or_path)
    if not text.strip():
        raise DatasetError(f"no dataset given: pass a registered name ({', '.join(DATASETS)}) or a file")
    looks_like_path = Path(text).suffix.lower() in SUFFIXES or "/" in text or os.sep in text
    info = None if looks_like_path else _lookup(text)
    if info is not None:
        if task is not None and task != info.task:
            raise DatasetError(f"{info.name} is a {info.task} dataset, not {task}")
        path = _download(info)
        return _load_file(path, info.task, limit, name=info.name, info=info)
    path = Path(text).expanduser()
    if not path.exists() and not looks_like_path:
        names = ", ".join(DATASETS)
        raise DatasetError(f"unknown dataset {text!r}: not a registered name ({names}) and no such file")
    known = _lookup(path.stem)
    return _load_file(path, task, limit, name=known.name if known else path.stem, info=known)


# --- reading files ------------------------------------------------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory, not a dataset file")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the file: {e.strerror or e}") from None


def _decode(data: bytes, path: Path) -> str:
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (spreadsheet exports write one)
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DatasetError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}): cannot read the file"
        ) from None


def _load_file(path: Path, task: str | None, limit: int | None, *, name: str, info: DatasetInfo | None) -> Dataset:
    suffix = path.suffix.lower()
    data = _read_bytes(path)
    sha = hashlib.sha256(data).hexdigest()
    default_source = info.source if info is not None and (task is None or task == info.task) else ""
    if suffix == ".csv":
        if task not in (None, "gpqa"):
            raise DatasetError(f"{path}: a CSV file is read as GPQA, not {task}")
        task = "gpqa"
        problems = _gpqa_problems(_decode(data, path), path, limit, default_source or "GPQA")
    elif suffix == ".jsonl":
        rows = _jsonl_rows(_decode(data, path), path)
        if task == "gpqa":
            raise DatasetError(f"{path}: GPQA is read from its official CSV layout, not JSONL")
        problems, task = _json_problems(rows, path, task, limit, default_source)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, name)
        if task == "gpqa":
            raise DatasetError(f"{path}: GPQA is read from its official CSV layout, not Parquet")
        problems, task = _json_problems(rows, path, task, limit, default_source)
    else:
        raise DatasetError(f"{path}: unsupported file type {suffix or '(none)'!r} (expected .jsonl or .csv)")
    if not problems:
        raise DatasetError(f"{path}: no problems in the file")
    return Dataset(name=name, path=path, sha256=sha, problems=tuple(problems), task=task)


def _jsonl_rows(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    # split on "\n" only: a JSON string may hold U+2028 and other characters str.splitlines() breaks at.
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
        yield where, row


def _parquet_rows(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        known = _lookup(name)
        instead = f", e.g. --dataset {known.example}" if known else ""
        raise DatasetError(
            f"{path}: reading a Parquet file needs pyarrow, which is not installed; pass a local JSONL instead{instead}"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types
        raise DatasetError(f"{path}: cannot read the Parquet file: {e}") from None
    for index, row in enumerate(table.to_pylist(), 1):
        yield f"{path}: row {index}", row


def _json_problems(rows, path: Path, task: str | None, limit: int | None, default_source: str):
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for where, row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {_type_name(row)}")
        if task is None:
            if "question_content" in row:
                task = "code"
            elif "problem" in row:
                task = "math"
            else:
                raise DatasetError(
                    f"{where}: cannot tell the layout: expected 'problem' and 'answer' (math) or "
                    f"'question_content' (LiveCodeBench code_generation_lite); pass task= to say which"
                )
        if task == "math":
            problem = _math_problem(row, where, default_source)
        else:
            problem = _code_problem(row, where, default_source or "LiveCodeBench")
        _check_unique(problem.id, where, seen)
        problems.append(problem)
        if limit is not None and len(problems) >= limit:
            break
    return problems, task or "math"


def _check_unique(problem_id: str, where: str, seen: dict[str, str]) -> None:
    if problem_id in seen:
        raise DatasetError(f"{where}: duplicate id {problem_id!r} (first at {seen[problem_id]})")
    seen[problem_id] = where


# --- fields -------------------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _get(row: dict, key: str, where: str, types: tuple[type, ...] = (str,), *, required: bool = True,
         default: Any = None) -> Any:
    if key not in row or (row[key] is None and not required):
        if required:
            raise DatasetError(f"{where}: missing field {key!r}")
        return default
    value = row[key]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        expected = " or ".join(_type_name(t()) for t in types)
        raise DatasetError(f"{where}: field {key!r} must be {expected}, got {_type_name(value)}")
    return value


def _text_id(row: dict, where: str, keys: tuple[str, ...]) -> str:
    """The first of `keys` present (a string or an integer), as a string."""
    for key in keys:
        if key in row:
            return str(_get(row, key, where, (str, int)))
    also = f" (or {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else ""
    raise DatasetError(f"{where}: missing field {keys[0]!r}{also}")


def _math_problem(row: dict, where: str, default_source: str) -> Problem:
    problem_id = _text_id(row, where, ("id", "unique_id", "problem_idx"))
    question = _get(row, "problem", where)
    answer = _get(row, "answer", where, (str, int))
    metadata: dict[str, Any] = {"source": _get(row, "source", where, required=False, default=default_source)}
    for key, types in (("subject", (str,)), ("level", (int, str)), ("solution", (str,)), ("problem_type", (list,))):
        if row.get(key) is not None:
            metadata[key] = _get(row, key, where, types)
    return Problem(id=problem_id, task="math", question=question, answer=str(answer), metadata=metadata)


# --- LiveCodeBench ------------------------------------------------------------------------------------------


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global (class, function), so only plain str/bytes/list/dict/tuple/number values load."""

    def find_class(self, module: str, name: str):
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _RefusedGlobal(f"persistent id {pid!r}")


def _decode_private_tests(value: Any, where: str) -> Any:
    """The official encodings of `private_test_cases`: plain JSON, or base64(zlib(pickle(JSON string)))."""
    key = "private_test_cases"
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise DatasetError(f"{where}: field {key!r} must be a string, got {_type_name(value)}")
    text = value.strip()
    if text.startswith("[") or not text:
        return _json_field(text or "[]", where, key)
    try:
        compressed = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise DatasetError(f"{where}: field {key!r} is neither JSON nor base64") from None
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(compressed, _MAX_DECODED_BYTES)
        if inflater.unconsumed_tail:
            raise DatasetError(f"{where}: field {key!r} decompresses to more than {_MAX_DECODED_BYTES} bytes")
    except zlib.error as e:
        raise DatasetError(f"{where}: field {key!r} is base64 but not zlib-compressed data ({e})") from None
    try:
        payload = _PlainUnpickler(io.BytesIO(raw)).load()
    except _RefusedGlobal as e:
        raise DatasetError(
            f"{where}: field {key!r}: refused to unpickle: the payload loads {e} "
            f"(only plain strings, lists and dicts are accepted)"
        ) from None
    except Exception as e:  # a truncated or otherwise broken pickle raises many kinds of error
        raise DatasetError(f"{where}: field {key!r} is not a valid pickle ({type(e).__name__}: {e})") from None
    if isinstance(payload, str):
        return _json_field(payload, where, key)
    if isinstance(payload, list):
        return payload
    raise DatasetError(f"{where}: field {key!r}: the pickle holds {_type_name(payload)}, expected a JSON string")


def _json_field(text: str, where: str, key: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: field {key!r} is malformed JSON: {e.msg} (column {e.colno})") from None


def _tests(value: Any, where: str, key: str) -> list[tuple[str, str, str]]:
    if not isinstance(value, list):
        raise DatasetError(f"{where}: field {key!r} must be a JSON array of tests, got {_type_name(value)}")
    tests = []
    for index, test in enumerate(value):
        at = f"{where}: {key}[{index}]"
        if not isinstance(test, dict):
            raise DatasetError(f"{at}: expected an object with input/output/testtype, got {_type_name(test)}")
        test_input = _get(test, "input", at)
        test_output = _get(test, "output", at)
        testtype = _get(test, "testtype", at)
        if testtype not in TEST_TYPES:
            raise DatasetError(f"{at}: testtype must be one of {', '.join(TEST_TYPES)}, got {testtype!r}")
        tests.append((test_input, test_output, testtype))
    return tests


def _code_problem(row: dict, where: str, default_source: str) -> Problem:
    problem_id = _text_id(row, where, ("question_id",))
    question = _get(row, "question_content", where)
    public = _get(row, "public_test_cases", where, (str, list))
    if isinstance(public, str):
        public = _json_field(public, where, "public_test_cases")
    public_tests = _tests(public, where, "public_test_cases")
    private = _decode_private_tests(_get(row, "private_test_cases", where, (str, list)), where)
    private_tests = _tests(private, where, "private_test_cases")
    meta = _get(row, "metadata", where, (str, dict), required=False, default={})
    if isinstance(meta, str):
        meta = _json_field(meta or "{}", where, "metadata")
    if not isinstance(meta, dict):
        raise DatasetError(f"{where}: field 'metadata' must be a JSON object, got {_type_name(meta)}")
    func_name = meta.get("func_name")
    if func_name is not None and not isinstance(func_name, str):
        raise DatasetError(f"{where}: metadata 'func_name' must be a string, got {_type_name(func_name)}")
    metadata: dict[str, Any] = {"source": default_source, "public_tests": len(public_tests)}
    for key, out in (("question_title", "title"), ("platform", "platform"), ("contest_id", "contest_id"),
                     ("contest_date", "contest_date"), ("difficulty", "difficulty")):
        if row.get(key) is not None:
            metadata[out] = _get(row, key, where)
    return Problem(
        id=problem_id, task="code", question=question, answer="",
        tests=tuple(public_tests + private_tests),
        starter_code=_get(row, "starter_code", where, required=False, default=""),
        func_name=func_name or None, metadata=metadata,
    )


# --- GPQA ---------------------------------------------------------------------------------------------------


def gpqa_order(key: str) -> list[int]:
    """The fixed choice order for a GPQA question: indices 0-3 (0 = the correct answer) sorted by
    sha256(f"{key}\\x1f{i}"), key = the Record ID (or the question text when a row has none)."""
    return sorted(range(4), key=lambda i: hashlib.sha256(f"{key}\x1f{i}".encode()).digest())


def _gpqa_problems(text: str, path: Path, limit: int | None, source: str) -> list[Problem]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except StopIteration:
        raise DatasetError(f"{path}: empty file, expected a GPQA CSV with the official header") from None
    except csv.Error as e:
        raise DatasetError(f"{path}:1: cannot read the CSV: {e}") from None
    header = [column.strip() for column in header]
    missing = [column for column in GPQA_REQUIRED if column not in header]
    if missing:
        raise DatasetError(
            f"{path}: not a GPQA CSV in the official layout: missing column(s) {', '.join(map(repr, missing))}"
        )
    columns = {column: index for index, column in reversed(list(enumerate(header)))}  # first occurrence wins
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    number = 0
    while True:
        start = reader.line_num + 1
        where = f"{path}:{start}"
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise DatasetError(f"{where}: cannot read the CSV: {e}") from None
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise DatasetError(f"{where}: {len(row)} fields, the header has {len(header)}")
        number += 1
        values = {column: row[index].strip() for column, index in columns.items()}  # stripped, as official harnesses do
        for column in GPQA_REQUIRED:
            if not values[column]:
                raise DatasetError(f"{where}: empty field {column!r}")
        question = values["Question"]
        options = [values[column] for column in GPQA_REQUIRED[1:]]
        record_id = values.get("Record ID", "")
        order = gpqa_order(record_id or question)
        problem_id = record_id or str(number)
        metadata = {"source": source, "record_id": record_id}
        for column, out in (("High-level domain", "domain"), ("Subdomain", "subdomain")):
            if values.get(column):
                metadata[out] = values[column]
        _check_unique(problem_id, where, seen)
        problems.append(Problem(
            id=problem_id, task="gpqa", question=question, answer=CHOICE_LETTERS[order.index(0)],
            choices=tuple(options[i] for i in order), metadata=metadata,
        ))
        if limit is not None and len(problems) >= limit:
            break
    return problems


# --- the Hub ------------------------------------------------------------------------------------------------


def _download(info: DatasetInfo) -> Path:
    hub = info.hub
    where = f"{hub.repo_id}/{hub.filename}"
    instead = f"pass a local file instead, e.g. --dataset {info.example}"
    if hub.gated:
        raise DatasetError(
            f"{info.name}: the Hub copy ({where}) is gated (accept its terms on huggingface.co and download it "
            f"yourself); {instead}"
        )
    try:
        from huggingface_hub import constants, errors, hf_hub_download
    except ImportError:
        raise DatasetError(f"{info.name}: huggingface_hub is not installed, so nothing can be downloaded; {instead}")
    try:
        return Path(hf_hub_download(hub.repo_id, hub.filename, repo_type="dataset", revision=hub.revision))
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE=1 is set" if constants.is_offline_mode() else "no network connection"
        raise DatasetError(
            f"{info.name}: the Hugging Face Hub is unreachable ({why}) and {where} is not in the local cache; "
            f"{instead}"
        ) from None
    except errors.GatedRepoError:
        raise DatasetError(f"{info.name}: {where} is gated on the Hub (accept its terms, log in); {instead}") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.EntryNotFoundError) as e:
        raise DatasetError(f"{info.name}: {where} was not found on the Hub ({type(e).__name__}); {instead}") from None
    except OSError as e:  # HfHubHTTPError and connection errors
        raise DatasetError(f"{info.name}: cannot download {where} from the Hub: {e}; {instead}") from None
