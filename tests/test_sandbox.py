"""The code sandbox and the LiveCodeBench judge: correct programs pass; hostile ones are stopped or refused.

Tests that need namespaces skip, with the reason, where `isolation_available()` says they are
unavailable; the refusal path is tested everywhere by simulating that.
"""

import concurrent.futures
import dataclasses
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from randkv_jax.eval import code_tests, sandbox
from randkv_jax.eval.code_tests import TestCase, judge, outputs_match
from randkv_jax.eval.sandbox import Limits, SandboxUnavailable, isolation_available, run_python

ISOLATED, WHY = isolation_available()
needs_isolation = pytest.mark.skipif(not ISOLATED, reason=f"sandbox isolation unavailable: {WHY}")

FAST = Limits(cpu_seconds=2, wall_seconds=6, memory_bytes=512 << 20, processes=8, output_bytes=1 << 20)

SUM_PROGRAM = """\
import sys
def main():
    a, b = map(int, sys.stdin.readline().split())
    print(a + b)
if __name__ == "__main__":
    main()
"""
TWO_SUM = """\
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        print("debug output does not count")
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)
            seen[x] = i
"""
TWO_SUM_TESTS = [TestCase("[2,7,11,15]\n9", "[0, 1]", "functional"), TestCase("[3,2,4]\n6", "[1,2]", "functional")]


def still_fine() -> None:
    """The harness goes on after whatever the last program did."""
    assert run_python("print('still fine')", limits=FAST).stdout == "still fine\n"


# --- judging -------------------------------------------------------------------------------------

@needs_isolation
def test_correct_stdin_program_passes():
    verdict = judge(SUM_PROGRAM, [TestCase("1 2\n", "3\n"), TestCase("40 2", "42  \n\n")], limits=FAST)
    assert verdict.passed and [r.passed for r in verdict.results] == [True, True]


@needs_isolation
def test_correct_functional_program_passes():
    verdict = judge(TWO_SUM, TWO_SUM_TESTS, func_name="twoSum", limits=FAST)
    assert verdict.passed, verdict.reason
    assert len(verdict.results) == 2


@needs_isolation
def test_wrong_output_fails_and_stops_at_the_first_failure():
    tests = [TestCase("1 2\n", "4\n"), TestCase("1 1\n", "2\n")]
    verdict = judge(SUM_PROGRAM, tests, limits=FAST)
    assert not verdict.passed
    assert len(verdict.results) == 1 and "wrong answer" in verdict.reason
    wrong = TWO_SUM.replace("(seen[target - x], i)", "[i, seen[target - x]]")
    verdict = judge(wrong, TWO_SUM_TESTS, func_name="twoSum", limits=FAST)
    assert not verdict.passed and "wrong answer" in verdict.reason
    crash = judge("raise ValueError('boom')", [TestCase("", "1")], limits=FAST)
    assert not crash.passed and "ValueError: boom" in crash.reason
    syntax = judge("class Solution\n", TWO_SUM_TESTS, func_name="twoSum", limits=FAST)
    assert not syntax.passed and "SyntaxError" in syntax.reason


@needs_isolation
def test_functional_infinite_loop_fails_on_its_time_limit():
    looping = "class Solution:\n    def twoSum(self, nums, target):\n        while True:\n            pass\n"
    limits = dataclasses.replace(FAST, cpu_seconds=1)
    verdict = judge(looping, TWO_SUM_TESTS, func_name="twoSum", limits=limits)
    assert not verdict.passed and verdict.reason == "cpu limit"


def test_outputs_match_like_livecodebench():
    assert outputs_match("3  \n\n", "3")[0]
    assert outputs_match("1 2.50\n", "1.0 2.5")[0]          # numbers compare by decimal value
    assert outputs_match("1000", "1e3")[0]
    assert not outputs_match("3\n4", "3")[0]                   # a different number of lines
    assert not outputs_match("0.3333333", "0.33333333")[0]    # no tolerance beyond the decimal value
    assert not outputs_match("Yes", "yes")[0]


def test_judge_rejects_bad_test_sets():
    with pytest.raises(ValueError):
        judge("pass", [TestCase("", "", "stdin"), TestCase("", "", "functional")], unsafe=True)
    with pytest.raises(ValueError):
        judge("pass", TWO_SUM_TESTS, unsafe=True)                 # no func_name
    assert not judge("pass", [], unsafe=True).passed


# --- limits ------------------------------------------------------------------------------------

@needs_isolation
def test_infinite_loop_is_stopped_by_the_cpu_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", limits=dataclasses.replace(FAST, cpu_seconds=1))
    assert result.reason == "cpu limit" and result.returncode < 0
    assert time.monotonic() - start < 5


@needs_isolation
def test_sleeping_forever_is_stopped_by_the_wall_timeout():
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(1000)\n", limits=dataclasses.replace(FAST, wall_seconds=1))
    assert result.timed_out and result.reason == "wall timeout"
    assert time.monotonic() - start < 4
    still_fine()


@needs_isolation
def test_unbounded_allocation_hits_the_memory_limit():
    program = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    result = run_python(program, limits=dataclasses.replace(FAST, memory_bytes=256 << 20))
    assert result.reason == "memory limit" and "MemoryError" in result.stderr


@needs_isolation
def test_file_size_is_limited():
    result = run_python("open('big', 'wb').write(b'x' * (4 << 20))\n",
                        limits=dataclasses.replace(FAST, file_bytes=1 << 20))
    assert result.reason == "file size limit"


@needs_isolation
def test_process_limit_counts_the_program_itself():
    program = """\
import os, time
made = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
except OSError:
    print(made)
"""
    result = run_python(program, limits=dataclasses.replace(FAST, processes=6))
    assert result.stdout == "5\n"


@needs_isolation
def test_fork_bomb_is_contained():
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.fork()\n", limits=dataclasses.replace(FAST, processes=8))
    assert result.returncode != 0 and result.reason
    assert time.monotonic() - start < FAST.wall_seconds + 3
    still_fine()


@needs_isolation
def test_stray_children_die_with_the_run():
    marker = f"randkv-stray-{uuid.uuid4().hex}"
    program = f"""\
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}], start_new_session=True)
print("left a child behind")
"""
    result = run_python(program, limits=FAST)
    assert result.stdout == "left a child behind\n"
    time.sleep(0.2)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert marker.encode() not in cmdline, f"process {pid} outlived its sandbox"


@needs_isolation
def test_huge_output_is_truncated_without_hanging():
    start = time.monotonic()
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", limits=FAST)
    assert result.reason == "output limit" and len(result.stdout) == FAST.output_bytes
    assert time.monotonic() - start < 4
    garbage = run_python("import os\nos.write(1, bytes(range(256)) * 4)\nos.write(2, b'\\xff\\xfe')\n", limits=FAST)
    assert garbage.returncode == 0 and len(garbage.stdout) == 1024 and garbage.stderr == "\ufffd\ufffd"


@needs_isolation
def test_program_killed_by_a_signal():
    result = run_python("import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n",
                        limits=FAST)
    assert result.returncode == -9 and result.reason == "killed by signal 9 (SIGKILL)" and result.stdout == "bye\n"
    segv = run_python("import ctypes\nctypes.string_at(0)\n", limits=FAST)
    assert segv.returncode == -11 and "SIGSEGV" in segv.reason


@needs_isolation
def test_closed_or_unread_stdin_does_not_hang():
    result = run_python("import os\nfor fd in (0, 1, 2):\n    os.close(fd)\n", "x" * (8 << 20), limits=FAST)
    assert result.returncode == 0


# --- isolation ---------------------------------------------------------------------------------

@needs_isolation
def test_writes_outside_the_work_dir_fail_and_leave_nothing(tmp_path):
    tag = uuid.uuid4().hex
    repo = Path(__file__).resolve().parents[1]
    outside = [tmp_path / "x", repo / f"sandbox-escape-{tag}", Path.home() / f"sandbox-escape-{tag}",
               Path(sys.prefix) / f"sandbox-escape-{tag}"]
    scratch = Path(f"/tmp/sandbox-escape-{tag}")           # the sandbox's own /tmp, or read-only
    program = f"""\
for path in {[str(p) for p in outside]!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("wrote", path)
    except OSError as e:
        print("refused", type(e).__name__)
try:
    open({str(scratch)!r}, "w").write("scratch")
except OSError:
    pass
open("inside.txt", "w").write("ok")
print(open("inside.txt").read())
"""
    result = run_python(program, limits=FAST)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stderr
    assert len(lines) == len(outside) + 1 and lines[-1] == "ok"
    assert all(line.startswith("refused") for line in lines[:-1]), lines
    for path in [*outside, scratch]:
        assert not path.exists(), f"{path} was written from inside the sandbox"


@needs_isolation
def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    program = f"""\
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=2)
        print("connected")
    except OSError as e:
        print("refused", e.errno)
try:
    socket.getaddrinfo("example.com", 80)
    print("resolved")
except OSError:
    print("no dns")
"""
    try:
        result = run_python(program, limits=FAST)
        with pytest.raises(BlockingIOError):
            server.accept()                                  # nobody reached the parent's server
    finally:
        server.close()
    lines = result.stdout.splitlines()
    assert lines[:2] == ["refused 101", "refused 101"] and lines[2] == "no dns", result.stdout  # ENETUNREACH


@needs_isolation
def test_program_cannot_undo_the_read_only_mounts():
    program = """\
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND = 32, 4096
print(libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None), os.strerror(ctypes.get_errno()))
print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
"""
    result = run_python(program, limits=FAST)
    assert result.stdout.splitlines() == ["-1 Operation not permitted", "0000000000000000"]


@needs_isolation
def test_runs_from_several_threads():
    programs = [f"print({i} * {i})" for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda p: run_python(p, limits=FAST), programs))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]


def test_refuses_without_isolation_unless_unsafe(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: (False, "simulated: no user namespaces"))
    with pytest.raises(SandboxUnavailable, match="simulated: no user namespaces") as refused:
        run_python("print(1)")
    assert "--unsafe-code-execution" in str(refused.value) and "unsafe=True" in str(refused.value)
    with pytest.raises(SandboxUnavailable):
        code_tests.judge(SUM_PROGRAM, [TestCase("1 2", "3")])
    result = run_python("print(input())", "rlimits only\n", limits=FAST, unsafe=True)
    assert result.stdout == "rlimits only\n" and not result.isolated
    assert judge(SUM_PROGRAM, [TestCase("1 2", "3")], limits=FAST, unsafe=True).passed


def test_limits_and_results_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Limits().cpu_seconds = 1
    assert Limits().memory_bytes == 2 << 30 and Limits().file_bytes == 16 << 20
