"""eval/datasets.py: the shared math sets, GPQA from its official CSV, LiveCodeBench JSONL, the Hub path, bad input."""

from __future__ import annotations

import base64
import csv
import dataclasses
import hashlib
import json
import os
import pickle
import re
import zlib
from pathlib import Path

import pytest

from randkv_jax.eval import datasets as ds
from randkv_jax.eval.datasets import DATASETS, DatasetError, Problem, load_dataset

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "eval"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
GPQA_CSV = FIXTURES / "gpqa_diamond_sample.csv"
LCB_JSONL = FIXTURES / "lcb_sample.jsonl"
LCB_MALICIOUS = FIXTURES / "lcb_malicious.jsonl"


def shared(filename: str) -> Path:
    path = SHARED / filename
    if not path.is_file():
        pytest.skip(f"the normalized copy {path} is absent (see ../shared/data/SOURCES.md)")
    return path


def encode_private_tests(tests: list[dict]) -> str:
    """LiveCodeBench's encoding of private_test_cases: base64(zlib(pickle(json string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def lcb_rows() -> list[dict]:
    return [json.loads(line) for line in LCB_JSONL.read_text(encoding="utf-8").splitlines()]


# --- the shared math sets -----------------------------------------------------------------------------------

SHARED_SETS = [
    ("math500.jsonl", "math500", 500, "f7d69897dc13eea6d028c08c29b5d749329ee2e01853de6720188540d883ec55"),
    ("aime25.jsonl", "aime2025", 30, "a211b7a49597101c93050239a3e772811cac55cefd775ff1a0a20d578f9425bc"),
    ("aime26.jsonl", "aime2026", 30, "80866a1c00787f4fcd7a125c1223ae6d454aae110a4a60f06209c705e38f9787"),
    ("hmmt_feb25.jsonl", "hmmt-feb-2025", 30, "a8dcc9a9a3575ff1799acd6ba5591b3b1b95bcdd060999fca2fa8179dc8ad2e6"),
]


@pytest.mark.parametrize("filename,name,rows,sha", SHARED_SETS)
def test_shared_math_files_load(filename, name, rows, sha):
    path = shared(filename)
    data = load_dataset(str(path))
    assert (data.name, data.task, len(data), data.sha256, data.path) == (name, "math", rows, sha, path)
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for problem, row in zip(data.problems, raw):
        assert problem.task == "math"
        assert (problem.id, problem.question, problem.answer) == (row["id"], row["problem"], row["answer"])
        assert problem.metadata["source"] == row["source"]
        assert problem.choices == () and problem.tests == () and problem.func_name is None
    assert len({p.id for p in data}) == rows


def test_math500_fields():
    data = load_dataset(str(shared("math500.jsonl")))
    first = data.problems[0]
    assert first.id == "test/precalculus/807.json"
    assert first.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert first.metadata["subject"] == "Precalculus" and first.metadata["level"] == 2
    assert first.metadata["solution"].startswith("We have that")
    levels = [p.metadata["level"] for p in data]
    assert {level: levels.count(level) for level in range(1, 6)} == {1: 43, 2: 90, 3: 105, 4: 128, 5: 134}


def test_aime_and_hmmt_answers():
    aime25 = load_dataset(str(shared("aime25.jsonl")))
    assert [p.answer for p in aime25.problems[:5]] == ["70", "588", "16", "117", "279"]
    assert {p.metadata["source"] for p in aime25} == {"AIME 2025 I", "AIME 2025 II"}
    aime26 = load_dataset(str(shared("aime26.jsonl")))
    assert [p.answer for p in aime26.problems[:3]] == ["277", "62", "79"]
    hmmt = load_dataset(str(shared("hmmt_feb25.jsonl")))
    assert hmmt.problems[0].answer == "103" and hmmt.problems[0].metadata["source"] == "HMMT February 2025"


def test_limit_reads_the_first_problems():
    path = shared("math500.jsonl")
    full = load_dataset(str(path))
    head = load_dataset(path, limit=7)
    assert head.problems == full.problems[:7]
    assert head.sha256 == full.sha256  # the file's hash, whatever the limit
    assert len(load_dataset(GPQA_CSV, limit=2)) == 2
    assert len(load_dataset(LCB_JSONL, limit=1)) == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(DatasetError, match="limit must be a positive integer"):
            load_dataset(path, limit=bad)


def test_math_hub_layouts(tmp_path):
    """The Hub copies' own field names: MATH-500 unique_id, math-ai integer ids, MathArena problem_idx."""
    rows = [
        {"problem": "1+1?", "solution": "2", "answer": "2", "subject": "Algebra", "level": 1, "unique_id": "test/a/1.json"},
        {"id": 7, "problem": "2+2?", "answer": 4},
        {"problem_idx": 3, "problem": "3+3?", "answer": "6", "problem_type": ["Algebra"]},
    ]
    path = write(tmp_path, "hub.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    data = load_dataset(path)
    assert [(p.id, p.answer) for p in data] == [("test/a/1.json", "2"), ("7", "4"), ("3", "6")]
    assert data.problems[0].metadata == {"source": "", "subject": "Algebra", "level": 1, "solution": "2"}
    assert data.problems[2].metadata["problem_type"] == ["Algebra"]
    # a file named like a registered set takes its name and default source
    named = load_dataset(write(tmp_path, "aime25.jsonl", json.dumps(rows[1]) + "\n"))
    assert named.name == "aime2025" and named.problems[0].metadata["source"] == "AIME 2025"


# --- GPQA ---------------------------------------------------------------------------------------------------


def gpqa_rows() -> list[dict]:
    with GPQA_CSV.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_gpqa_csv_layout_and_gold_letter():
    data = load_dataset(GPQA_CSV)
    assert (data.task, data.name, len(data)) == ("gpqa", "gpqa_diamond_sample", 3)
    for problem, row in zip(data, gpqa_rows()):
        assert problem.task == "gpqa" and problem.id == row["Record ID"]
        assert problem.question == row["Question"].strip()
        assert sorted(problem.choices) == sorted(row[c].strip() for c in ds.GPQA_REQUIRED[1:])
        assert problem.choices["ABCD".index(problem.answer)] == row["Correct Answer"].strip()
        assert problem.metadata["domain"] == row["High-level domain"]
        assert problem.metadata["subdomain"] == row["Subdomain"]
    first = data.problems[0]
    assert "henry" in first.choices and "gauss" in first.choices  # "henry\n", " gauss" stripped
    assert not first.question.endswith("\n")
    assert [p.answer for p in data] == ["D", "A", "B"]  # differs across questions


def test_gpqa_shuffle_is_deterministic_and_follows_the_documented_rule(tmp_path):
    first = load_dataset(GPQA_CSV)
    assert load_dataset(GPQA_CSV) == first
    for problem, row in zip(first, gpqa_rows()):
        options = [row[c].strip() for c in ds.GPQA_REQUIRED[1:]]
        digest = {i: hashlib.sha256(f"{row['Record ID']}\x1f{i}".encode()).digest() for i in range(4)}
        assert problem.choices == tuple(options[i] for i in sorted(range(4), key=digest.get))
    # rows in another order, or another file: the same choices and letter per question
    rows = gpqa_rows()[::-1]
    reversed_csv = tmp_path / "reversed.csv"
    with reversed_csv.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    by_id = {p.id: p for p in load_dataset(reversed_csv)}
    assert all(by_id[p.id] == p for p in first)


def test_gpqa_without_record_id_seeds_from_the_question(tmp_path):
    header = "Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
    path = write(tmp_path, "mine.csv", header + "What is 2+2?,4,3,5,22\n")
    problem = load_dataset(path).problems[0]
    assert problem.id == "1"
    assert problem.choices == tuple(["4", "3", "5", "22"][i] for i in ds.gpqa_order("What is 2+2?"))
    assert problem.choices["ABCD".index(problem.answer)] == "4"


# --- LiveCodeBench ------------------------------------------------------------------------------------------


def test_lcb_public_and_private_tests():
    data = load_dataset(LCB_JSONL)
    assert (data.task, len(data)) == ("code", 2)
    stdin, functional = data.problems
    assert stdin.id == "abc900_a" and stdin.func_name is None and stdin.starter_code == ""
    assert stdin.answer == "" and stdin.choices == ()
    assert stdin.question.startswith("You are given two integers A and B.")
    assert stdin.tests == (("3 5\n", "8\n", "stdin"), ("1 1\n", "2\n", "stdin"), ("100 100\n", "200\n", "stdin"))
    assert stdin.metadata == {
        "source": "LiveCodeBench", "public_tests": 1, "title": "Add Two Numbers", "platform": "atcoder",
        "contest_id": "abc900", "contest_date": "2024-08-03T00:00:00", "difficulty": "easy",
    }
    assert functional.id == "9001" and functional.func_name == "countEven"
    assert functional.starter_code.startswith("class Solution:\n    def countEven(self, nums: List[int]) -> int:")
    assert functional.tests == (
        ("[1, 2, 4]", "2", "functional"), ("[]", "0", "functional"), ("[2, 2, 3]", "2", "functional"),
        ("[7]", "0", "functional"),
    )
    assert functional.metadata["platform"] == "leetcode" and functional.metadata["difficulty"] == "medium"


def test_lcb_fixture_private_tests_are_encoded_the_official_way(tmp_path):
    stdin, functional = lcb_rows()
    assert stdin["private_test_cases"].startswith("[")  # plain JSON (older releases)
    raw = pickle.loads(zlib.decompress(base64.b64decode(functional["private_test_cases"])))  # our own fixture
    assert isinstance(raw, str) and json.loads(raw)[0] == {"input": "[]", "output": "0", "testtype": "functional"}
    # and a freshly encoded row reads back the same
    functional["private_test_cases"] = encode_private_tests(json.loads(raw))
    path = write(tmp_path, "lcb.jsonl", json.dumps(functional) + "\n")
    assert load_dataset(path).problems[0] == load_dataset(LCB_JSONL).problems[1]


def test_malicious_pickle_is_refused(tmp_path):
    with pytest.raises(DatasetError, match=r"lcb_malicious\.jsonl:2: .*refused to unpickle.*system"):
        load_dataset(LCB_MALICIOUS)

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    row = lcb_rows()[1]
    row["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    path = write(tmp_path, "evil.jsonl", json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=r"evil\.jsonl:1: .*refused to unpickle.*Path"):
        load_dataset(path)
    assert not marker.exists()


@pytest.mark.parametrize("value,message", [
    ("not base64 !!", "neither JSON nor base64"),
    (base64.b64encode(b"plain bytes").decode(), "not zlib-compressed"),
    (base64.b64encode(zlib.compress(b"garbage")).decode(), "not a valid pickle"),
    (base64.b64encode(zlib.compress(pickle.dumps(42))).decode(), "expected a JSON string"),
    (base64.b64encode(zlib.compress(pickle.dumps("[oops"))).decode(), "malformed JSON"),
    ("[{\"input\": \"1\"}]", r"private_test_cases\[0\]: missing field 'output'"),
    ("[{\"input\": \"1\", \"output\": \"1\", \"testtype\": \"exec\"}]", "testtype must be one of"),
])
def test_bad_private_tests(tmp_path, value, message):
    row = lcb_rows()[1]
    row["private_test_cases"] = value
    path = write(tmp_path, "lcb.jsonl", json.dumps(lcb_rows()[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=rf"lcb\.jsonl:2: .*{message}"):
        load_dataset(path)


def test_lcb_missing_field_and_bad_metadata(tmp_path):
    row = lcb_rows()[0]
    del row["public_test_cases"]
    with pytest.raises(DatasetError, match=r"a\.jsonl:1: missing field 'public_test_cases'"):
        load_dataset(write(tmp_path, "a.jsonl", json.dumps(row) + "\n"))
    row = lcb_rows()[0]
    row["metadata"] = "{not json"
    with pytest.raises(DatasetError, match=r"b\.jsonl:1: field 'metadata' is malformed JSON"):
        load_dataset(write(tmp_path, "b.jsonl", json.dumps(row) + "\n"))


# --- bad input ----------------------------------------------------------------------------------------------

GOOD = json.dumps({"id": "1", "problem": "1+1?", "answer": "2", "source": "x"})


@pytest.mark.parametrize("lines,message", [
    ([GOOD, '{"id": "2", "problem": "2+2?", "answer": '], r":2: malformed JSON"),
    ([GOOD, "", GOOD.replace('"1"', '"2"'), "[1, 2]"], r":4: expected a JSON object, got an array"),
    ([GOOD, json.dumps({"id": "2", "problem": "2+2?"})], r":2: missing field 'answer'"),
    ([json.dumps({"problem": "2+2?", "answer": "4"})], r":1: missing field 'id' \(or 'unique_id', 'problem_idx'\)"),
    ([GOOD, json.dumps({"id": "2", "problem": ["2+2?"], "answer": "4"})], r":2: field 'problem' must be a string, got an array"),
    ([GOOD, json.dumps({"id": "2", "problem": "2+2?", "answer": None})], r":2: field 'answer' must be a string or an integer, got null"),
    ([GOOD, json.dumps({"id": True, "problem": "2+2?", "answer": "4"})], r":2: field 'id' must be a string or an integer, got a boolean"),
    ([GOOD, GOOD], r":2: duplicate id '1' \(first at .*:1\)"),
    ([json.dumps({"question": "2+2?", "answer": "4"})], r":1: cannot tell the layout"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, lines, message):
    path = write(tmp_path, "bad.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}{message}"):
        load_dataset(path)


def test_unreadable_files_name_the_file(tmp_path):
    undecodable = write(tmp_path, "bytes.jsonl", (GOOD + "\n").encode() + b'{"id": "\xff"}\n')
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(undecodable))}:2: not valid UTF-8"):
        load_dataset(undecodable)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(missing))}: no such file"):
        load_dataset(missing)
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(folder))}: is a directory"):
        load_dataset(folder)
    empty = write(tmp_path, "empty.jsonl", "\n\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(empty))}: no problems"):
        load_dataset(empty)
    other = write(tmp_path, "data.json", GOOD)
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(other))}: unsupported file type '.json'"):
        load_dataset(other)


def test_unreadable_csv_names_the_file(tmp_path):
    not_gpqa = write(tmp_path, "scores.csv", "name,score\nalice,3\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(not_gpqa))}: not a GPQA CSV .*missing column\(s\) 'Question'"):
        load_dataset(not_gpqa)
    undecodable = write(tmp_path, "latin1.csv", GPQA_CSV.read_bytes() + b"\xe9t\xe9\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(undecodable))}:\d+: not valid UTF-8"):
        load_dataset(undecodable)
    empty = write(tmp_path, "empty.csv", "")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(empty))}: empty file"):
        load_dataset(empty)
    header = "Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
    blank = write(tmp_path, "blank.csv", header + "Q1,a,b,c,d\n\"Q2\nspans two lines\",a,b,,d\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(blank))}:3: empty field 'Incorrect Answer 2'"):
        load_dataset(blank)
    short = write(tmp_path, "short.csv", header + "Q1,a,b,c,d\nQ2,a,b\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(short))}:3: 3 fields, the header has 5"):
        load_dataset(short)
    with pytest.raises(DatasetError, match="a CSV file is read as GPQA, not math"):
        load_dataset(GPQA_CSV, task="math")


def test_task_argument(tmp_path):
    assert load_dataset(LCB_JSONL, task="code").task == "code"
    with pytest.raises(DatasetError, match=r"lcb_sample\.jsonl:1: missing field 'id'"):
        load_dataset(LCB_JSONL, task="math")
    with pytest.raises(DatasetError, match="unknown task 'essay'"):
        load_dataset(LCB_JSONL, task="essay")
    with pytest.raises(DatasetError, match="GPQA is read from its official CSV"):
        load_dataset(LCB_JSONL, task="gpqa")
    with pytest.raises(DatasetError, match="math500 is a math dataset, not code"):
        load_dataset("math500", task="code")


def test_unknown_name_lists_the_registered_names():
    with pytest.raises(DatasetError) as error:
        load_dataset("mmlu")
    message = str(error.value)
    assert message.startswith("unknown dataset 'mmlu'")
    for name in ("math500", "aime2025", "aime2026", "hmmt-feb-2025", "gpqa-diamond", "livecodebench"):
        assert name in message
    with pytest.raises(DatasetError, match="no dataset given"):
        load_dataset("")


# --- the registry and the Hub -------------------------------------------------------------------------------


def test_registry():
    assert set(DATASETS) == {"math500", "aime2025", "aime2026", "hmmt-feb-2025", "gpqa-diamond", "livecodebench"}
    tasks = {name: info.task for name, info in DATASETS.items()}
    assert tasks == {"math500": "math", "aime2025": "math", "aime2026": "math", "hmmt-feb-2025": "math",
                     "gpqa-diamond": "gpqa", "livecodebench": "code"}
    assert DATASETS["math500"].hub == ds.HubFile("HuggingFaceH4/MATH-500", "test.jsonl")
    assert DATASETS["livecodebench"].hub.repo_id == "livecodebench/code_generation_lite"
    assert DATASETS["gpqa-diamond"].hub.gated


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache, so nothing cached on this machine can answer; offline as tests/conftest.py sets."""
    from huggingface_hub import constants

    assert os.environ.get("HF_HUB_OFFLINE") == "1" and constants.is_offline_mode()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.mark.parametrize("name", ["math500", "aime2025", "aime2026", "hmmt-feb-2025", "livecodebench", "aime25"])
def test_hub_path_offline_error(empty_hub_cache, name):
    info = ds._lookup(name)
    with pytest.raises(DatasetError) as error:
        load_dataset(name)
    message = str(error.value)
    assert "Hugging Face Hub is unreachable (HF_HUB_OFFLINE=1 is set)" in message
    assert f"{info.hub.repo_id}/{info.hub.filename}" in message
    assert f"pass a local file instead, e.g. --dataset {info.example}" in message


def test_gpqa_hub_copy_is_gated():
    with pytest.raises(DatasetError, match=r"gpqa-diamond: the Hub copy \(Idavidrein/gpqa/gpqa_diamond\.csv\) is gated"):
        load_dataset("gpqa-diamond")


def test_hub_download_is_parsed_like_a_local_file(monkeypatch):
    """Where the Hub answers, the downloaded file is read with the registered name and task."""
    path = shared("aime26.jsonl")
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        return str(path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    data = load_dataset("aime2026", limit=4)
    assert calls == [("math-ai/aime26", "aime2026.jsonl", {"repo_type": "dataset", "revision": None})]
    assert (data.name, data.task, data.path, len(data)) == ("aime2026", "math", path, 4)


def test_problem_is_frozen_and_hashable():
    problem = load_dataset(LCB_JSONL).problems[1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.answer = "x"  # type: ignore[misc]
    assert hash(problem) == hash(dataclasses.replace(problem, metadata={}))
    assert isinstance(problem, Problem)


def test_parquet_without_pyarrow_says_what_to_pass(tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pyarrow is installed: the Parquet path reads the file")
    path = write(tmp_path, "hmmt_feb_2025.parquet", b"PAR1")
    with pytest.raises(DatasetError, match=r"needs pyarrow.*--dataset \.\./shared/data/hmmt_feb25\.jsonl"):
        load_dataset(path)
