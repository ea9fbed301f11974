"""Judge a LiveCodeBench program against its tests, in the sandbox (`randkv_jax.eval.sandbox`).

Follows LiveCodeBench's grader (`lcb_runner/evaluation/testing_util.py`), reimplemented:

* The program runs after a prelude of star imports of common standard modules (string, re,
  collections, heapq, math, itertools, typing, ...) and `sys.setrecursionlimit(50000)`, as there.
* stdin tests: one sandboxed process per test, the test input on stdin. `SystemExit` is ignored,
  any other exception is a runtime error. Outputs match when, after stripping the whole text and
  then each line, they have as many lines and every line is equal, or every whitespace-separated
  token of the line parses as a `Decimal` on both sides and the token lists are equal (so
  "1.0" == "1" and "2.50" == "2.5"; like LiveCodeBench, no tolerance beyond exact decimal value).
* functional tests (LeetCode style, `class Solution: def f(self, ...)`): the input is one JSON value
  per line (the arguments), the output one JSON value. One driver process per program calls
  `Solution().<func_name>(*args)` for every test in turn (a module-level function if there is no
  `Solution` class) and compares the result with `==` after turning a tuple into a list. Each call
  gets `limits.cpu_seconds` of CPU and `limits.wall_seconds` of wall time (interval timers in
  the driver); the process as a whole gets those times the number of tests. The program's own
  prints go to stderr, the driver's results to the original stdout.
* The first failing test stops the judging, and a program passes only if every test passes.

All tests of a problem are of one kind (as in LiveCodeBench); mixing them is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation

from randkv_jax.eval.sandbox import Limits, Result, run_python

__all__ = ["TestCase", "TestResult", "Verdict", "judge", "outputs_match"]

_PRELUDE_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                    "statistics", "itertools", "functools", "operator", "io", "sys", "json", "typing")
PRELUDE = ("".join(f"from {m} import *\n" for m in _PRELUDE_MODULES) + "from builtins import *\n"
           + f"import {', '.join(_PRELUDE_MODULES)}\nsys.setrecursionlimit(50000)\n")


@dataclass(frozen=True)
class TestCase:
    input: str
    output: str
    testtype: str = "stdin"           # "stdin" or "functional"

    __test__ = False                  # not a pytest test class


@dataclass(frozen=True)
class TestResult:
    passed: bool
    reason: str = ""                  # why it failed ("wrong answer ...", "cpu limit", "runtime error ...")

    __test__ = False


@dataclass(frozen=True)
class Verdict:
    passed: bool
    results: tuple[TestResult, ...]   # the tests run, in order, up to and including the first failure

    @property
    def reason(self) -> str:
        return next((r.reason for r in self.results if not r.passed), "" if self.passed else "no tests")


def judge(program: str, tests: list[TestCase], *, func_name: str | None = None, limits: Limits = Limits(),
          unsafe: bool = False) -> Verdict:
    """Run `program` against `tests` in the sandbox; it passes only if every test passes.

    Raises sandbox.SandboxUnavailable when isolation is unavailable and `unsafe` is False.
    """
    kinds = {t.testtype for t in tests}
    if not kinds <= {"stdin", "functional"}:
        raise ValueError(f"unknown test types {sorted(kinds - {'stdin', 'functional'})}")
    if len(kinds) > 1:
        raise ValueError("a problem's tests must all be stdin tests or all functional tests")
    if not tests:
        return Verdict(False, ())
    if kinds == {"functional"}:
        if not func_name:
            raise ValueError("functional tests need func_name")
        results = _judge_functional(program, tests, func_name, limits, unsafe)
    else:
        results = []
        for test in tests:
            results.append(_judge_stdin(program, test, limits, unsafe))
            if not results[-1].passed:
                break
    passed = len(results) == len(tests) and all(r.passed for r in results)
    return Verdict(passed, tuple(results))


# --- stdin tests -------------------------------------------------------------------------------

_STDIN_DRIVER = """\
_globals = {{"__name__": "__main__", "__builtins__": __builtins__}}
exec(compile({prelude!r}, "<prelude>", "exec"), _globals)
try:
    exec(compile({program!r}, "solution.py", "exec"), _globals)
except SystemExit:
    pass
"""


def _judge_stdin(program: str, test: TestCase, limits: Limits, unsafe: bool) -> TestResult:
    source = _STDIN_DRIVER.format(prelude=PRELUDE, program=program)
    result = run_python(source, test.input, limits=limits, unsafe=unsafe)
    if result.returncode != 0 or result.reason:
        return TestResult(False, _failure(result))
    ok, why = outputs_match(result.stdout, test.output)
    return TestResult(ok, why)


def outputs_match(got: str, expected: str) -> tuple[bool, str]:
    """LiveCodeBench's stdout comparison; (False, why) on a mismatch."""
    got_lines, want_lines = _stripped_lines(got), _stripped_lines(expected)
    if len(got_lines) != len(want_lines):
        return False, f"wrong answer: {len(got_lines)} lines, expected {len(want_lines)}"
    for number, (line, want) in enumerate(zip(got_lines, want_lines), 1):
        if line == want:
            continue
        numbers, wanted = _decimals(line), _decimals(want)
        if numbers is None or wanted is None or numbers != wanted:
            return False, f"wrong answer on line {number}: got {_short(line)}, expected {_short(want)}"
    return True, ""


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except (InvalidOperation, ValueError):
        return None


# --- functional tests --------------------------------------------------------------------------

_FUNCTIONAL_DRIVER = """\
import json, os, signal, sys

_results = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)                          # the program's own prints go to stderr

def _emit(**fields):
    _results.write(json.dumps(fields) + "\\n")
    _results.flush()

class _TimeLimit(BaseException):
    pass

def _on_timer(reason):
    def handler(signum, frame):
        raise _TimeLimit(reason)
    return handler

signal.signal(signal.SIGALRM, _on_timer("wall timeout"))
signal.signal(signal.SIGPROF, _on_timer("cpu limit"))
_globals = {{"__name__": "solution", "__builtins__": __builtins__}}
try:
    exec(compile({prelude!r}, "<prelude>", "exec"), _globals)
    exec(compile({program!r}, "solution.py", "exec"), _globals)
    _owner = _globals["Solution"]() if isinstance(_globals.get("Solution"), type) else None
    _method = getattr(_owner, {func_name!r}) if _owner is not None else _globals[{func_name!r}]
except BaseException as e:
    _emit(error=f"{{type(e).__name__}}: {{e}}"[:300])
    sys.exit(0)

for _index, (_input, _output) in enumerate(json.loads({tests!r})):
    try:
        _args = [json.loads(line) for line in _input.split("\\n")]
        _expected = json.loads(_output)
    except ValueError as e:
        _emit(i=_index, ok=False, reason=f"bad test case: {{e}}"[:300])
        break
    try:
        signal.setitimer(signal.ITIMER_PROF, {cpu})
        signal.setitimer(signal.ITIMER_REAL, {wall})
        _got = _method(*_args)
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(_got, tuple):
            _got = list(_got)
        _ok = bool(_got == _expected)
    except _TimeLimit as e:
        _emit(i=_index, ok=False, reason=str(e))
        break
    except MemoryError:
        _emit(i=_index, ok=False, reason="memory limit")
        break
    except BaseException as e:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        _emit(i=_index, ok=False, reason=f"runtime error: {{type(e).__name__}}: {{e}}"[:300])
        break
    if not _ok:
        _emit(i=_index, ok=False, reason=f"wrong answer: got {{repr(_got)[:100]}}, expected {{repr(_expected)[:100]}}")
        break
    _emit(i=_index, ok=True)
"""


def _judge_functional(program: str, tests: list[TestCase], func_name: str, limits: Limits,
                      unsafe: bool) -> list[TestResult]:
    n = len(tests)
    source = _FUNCTIONAL_DRIVER.format(
        prelude=PRELUDE, program=program, func_name=func_name, cpu=float(limits.cpu_seconds),
        wall=float(limits.wall_seconds), tests=json.dumps([[t.input, t.output] for t in tests]))
    whole = replace(limits, cpu_seconds=limits.cpu_seconds * n, wall_seconds=limits.wall_seconds * n + 5)
    result = run_python(source, "", limits=whole, unsafe=unsafe)
    results: list[TestResult] = []
    for line in result.stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if "error" in record:
            return [TestResult(False, f"compile error: {record['error']}")]
        if record.get("i") == len(results):
            results.append(TestResult(bool(record.get("ok")), str(record.get("reason", ""))))
            if not results[-1].passed:
                return results
    if len(results) < n:                 # the driver died (a limit, a signal, os._exit) mid-way
        results.append(TestResult(False, _failure(result) if (result.returncode or result.reason)
                                  else "the program ended the driver early"))
    return results


def _failure(result: Result) -> str:
    reason = result.reason or f"exit status {result.returncode}"
    if reason.startswith(("exit status", "killed by signal")):
        last = (result.stderr.strip().splitlines() or [""])[-1]
        return f"runtime error ({reason}){': ' + _short(last, 200) if last else ''}"
    return reason


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
