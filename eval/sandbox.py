"""Run an untrusted Python program in a throw-away sandbox: Linux namespaces plus rlimits.

    result = run_python("print(input()[::-1])", "abc\\n", limits=Limits(cpu_seconds=2))

`isolation_available()` says whether isolation works here (and why not). A run:

* `unshare --user --map-root-user --net --mount --pid --ipc --uts --kill-child --mount-proc`
  starts this file as a small bootstrap (`python -I -S sandbox.py --bootstrap CONFIG`), which
  sets up the namespace, applies the rlimits, empties the capability bounding set (and sets
  no_new_privs), then forks and execs the program as `python -I -S -B -X utf8 prog.py`
  (standard library only). The user namespace makes this work unprivileged; the program is
  uid 0 inside it (the caller's uid outside) without any capability, so it cannot undo the
  mounts below.
* Network: a new network namespace has only a loopback that is down: every connect, to
  127.0.0.1 as much as elsewhere, fails with ENETUNREACH, and DNS fails.
* Filesystem: in the new mount namespace (private propagation) every visible mount is
  remounted read-only, nosuid and nodev (/dev/null, zero, full, random and urandom are bound
  back, still openable). The working directory is a new tmpfs of `file_bytes` + 4 MiB (plus the
  program's size), mounted over /tmp unless the interpreter lives under /tmp (then over the
  host's throw-away directory); /run, /var/tmp and /dev/shm are covered by empty read-only
  tmpfs mounts (no host unix sockets there). Writes anywhere else fail (EROFS or ENOENT), and
  nothing written survives the run.
* Processes: the bootstrap is the pid namespace's init; when it exits, or is killed on a wall
  timeout, the kernel kills every process left inside. RLIMIT_NPROC is counted per user
  namespace and uid (Linux >= 5.14), so for a non-root caller it bounds the sandbox's tasks
  (processes and threads) whatever else that user runs; for uid 0 the kernel never enforces
  it, so a root caller puts the bootstrap in a new pids cgroup (cgroup v1 `pids` hierarchy, or
  v2 with the pids controller) with pids.max = the limit, and without one isolation is
  unavailable.
* rlimits (in the bootstrap, before the fork): RLIMIT_CPU (SIGXCPU at the limit), RLIMIT_AS,
  RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_CORE = 0, RLIMIT_NOFILE = 256. The parent enforces the
  wall timeout (SIGKILL to the process group, which brings the namespace down) and reads
  stdout/stderr as they come, keeping `output_bytes` of each; more stops the run.

Not isolated: reads (the program can read whatever the caller's uid can), and unix sockets
bound outside /tmp, /run, /var/tmp and /dev/shm.

Where isolation is unavailable, `run_python` raises `SandboxUnavailable` unless `unsafe=True`
(the CLI's `--unsafe-code-execution`): the program then runs with the rlimits only, in its own
session, and its leftover descendants are killed afterwards (RLIMIT_NPROC is then the caller's
current task count plus the limit; root is not bound by it at all).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass

__all__ = ["Limits", "Result", "SandboxUnavailable", "isolation_available", "run_python"]

UNSAFE_FLAG = "--unsafe-code-execution"


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run."""

    cpu_seconds: float = 10            # RLIMIT_CPU per process (SIGXCPU, then SIGKILL one second later)
    wall_seconds: float = 20           # wall clock, enforced by the parent
    memory_bytes: int = 2 << 30        # RLIMIT_AS per process (Python itself needs some tens of MiB)
    file_bytes: int = 16 << 20         # RLIMIT_FSIZE; the writable tmpfs holds this + 4 MiB (+ the program)
    processes: int = 32                # processes + threads of the program at once, itself included
    output_bytes: int = 8 << 20        # kept of stdout and of stderr each; more stops the run


@dataclass(frozen=True)
class Result:
    """How a run ended. `returncode` is the exit status, or -N when the program died of signal N."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False            # stopped by the wall timeout
    reason: str = ""                   # "" on exit 0; else e.g. "wall timeout", "cpu limit", "exit status 1"
    isolated: bool = True              # False: ran with rlimits only (unsafe=True, no isolation here)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.reason


class SandboxUnavailable(RuntimeError):
    """Isolation is unavailable here and the caller did not allow unsafe execution."""


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------

_UNSHARE = ["--user", "--map-root-user", "--net", "--mount", "--pid", "--ipc", "--uts", "--kill-child",
            "--mount-proc"]
_PYTHON_FLAGS = ["-I", "-S", "-B", "-X", "utf8"]
_GRACE = 2.0            # seconds to drain the pipes after the run ends or is killed
_STATUS_CAP = 1 << 16

_probe_lock = threading.Lock()
_probe_result: tuple[bool, str] | None = None


def isolation_available() -> tuple[bool, str]:
    """(True, "") when namespaced runs work here, else (False, why). Probed once, then cached."""
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            _probe_result = _probe()
        return _probe_result


def run_python(source: str, stdin: str = "", *, limits: Limits = Limits(), unsafe: bool = False) -> Result:
    """Run `source` as a Python program with `stdin` as its standard input, sandboxed.

    Raises SandboxUnavailable if isolation is unavailable and `unsafe` is False. Never raises for
    anything the program does: the outcome is in the Result.
    """
    ok, why = isolation_available()
    if not ok and not unsafe:
        raise SandboxUnavailable(
            f"sandboxed code execution is unavailable here: {why}. Pass unsafe=True (CLI flag "
            f"{UNSAFE_FLAG}) to run generated code with resource limits (rlimits) only, without "
            f"filesystem, network or process isolation.")
    return _run(source, stdin, limits, isolate=ok)


def _unshare_binary() -> str | None:
    return shutil.which("unshare") or next((p for p in ("/usr/bin/unshare", "/bin/unshare") if os.path.exists(p)), None)


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"Linux namespaces are unavailable on {sys.platform}"
    if _unshare_binary() is None:
        return False, "the util-linux `unshare` program was not found"
    if os.geteuid() == 0 and _pids_cgroup_parent() is None:
        return False, ("running as root, where RLIMIT_NPROC is not enforced, and no writable pids cgroup "
                       "(cgroup v1 `pids` hierarchy or cgroup v2 with the pids controller) was found to "
                       "bound the number of processes")
    outside = tempfile.mkdtemp(prefix="randkv-sandbox-probe-")
    canary = os.path.join(outside, "canary")
    probe = f"""
import errno, os, socket
try:
    open({canary!r}, "w").write("x")
    raise SystemExit("a write outside the working directory succeeded")
except OSError:
    pass
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    raise SystemExit("a network connection succeeded")
except OSError as e:
    if e.errno != errno.ENETUNREACH:
        raise SystemExit(f"the network is reachable ({{e}})")
open("scratch", "w").write("ok")
print(open("scratch").read())
"""
    try:
        result = _run(probe, "", Limits(cpu_seconds=5, wall_seconds=15, processes=8), isolate=True)
    except SandboxUnavailable as e:
        return False, str(e)
    except Exception as e:                  # OSError, or anything else unexpected: fail closed
        return False, f"could not start the sandbox ({type(e).__name__}: {e})"
    finally:
        leaked = os.path.exists(canary)
        shutil.rmtree(outside, ignore_errors=True)
    if leaked:
        return False, "the probe program could write outside its working directory"
    if result.returncode != 0 or result.stdout.strip() != "ok":
        detail = (result.stderr.strip().splitlines() or [result.reason or "no output"])[-1]
        return False, f"the namespace probe failed ({detail})"
    return True, ""


def _run(source: str, stdin: str, limits: Limits, *, isolate: bool) -> Result:
    with tempfile.TemporaryDirectory(prefix="randkv-sandbox-", ignore_cleanup_errors=True) as root:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        with open(os.path.join(work, "prog.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(source)
        try:
            cgroup = _make_pids_cgroup(limits.processes + 1) if isolate and os.geteuid() == 0 else None
        except OSError as e:
            raise SandboxUnavailable(f"could not create a pids cgroup for the sandbox ({e})") from e
        try:
            return _spawn(work, stdin, limits, isolate, cgroup)
        finally:
            if cgroup:
                _remove_cgroup(cgroup)


def _spawn(work: str, stdin: str, limits: Limits, isolate: bool, cgroup: str | None) -> Result:
    config = {"work": work, "limits": asdict(limits), "isolate": isolate, "cgroup": cgroup,
              "python": sys.executable}
    status_r, status_w = os.pipe()
    config["status_fd"] = status_w
    boot = [sys.executable, *_PYTHON_FLAGS, os.path.abspath(__file__), "--bootstrap", json.dumps(config)]
    if isolate:
        unshare = _unshare_binary()
        assert unshare is not None
        boot = [unshare, *_UNSHARE, *boot]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode("utf-8", "surrogatepass"))
        stdin_file.seek(0)
        try:
            proc = subprocess.Popen(boot, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(status_w,), cwd=work, env=env, start_new_session=True)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        try:
            out, err, status, timed_out, overflow = _communicate(proc, status_r, limits)
        finally:
            _kill_group(proc)
            os.close(status_r)
            proc.stdout.close()
            proc.stderr.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    return _result(proc, out, err, status, timed_out, overflow, limits, isolate)


def _communicate(proc: subprocess.Popen, status_r: int, limits: Limits):
    """Read stdout, stderr and the bootstrap's status pipe until EOF, the wall timeout or overflow."""
    caps = {proc.stdout.fileno(): limits.output_bytes, proc.stderr.fileno(): limits.output_bytes,
            status_r: _STATUS_CAP}
    bufs = {fd: bytearray() for fd in caps}
    sel = selectors.DefaultSelector()
    for fd in caps:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.wall_seconds
    stop_at = None                          # once set: drain until then, then give up
    timed_out = overflow = False
    try:
        while sel.get_map():
            now = time.monotonic()
            if stop_at is None and now >= deadline:
                timed_out = True
                _kill_group(proc)
                stop_at = now + _GRACE
            elif stop_at is None and _exited(proc):
                _kill_group(proc)           # stray children of an unisolated run hold the pipes
                stop_at = now + _GRACE
            if stop_at is not None and now >= stop_at:
                break
            wait = min(deadline if stop_at is None else stop_at, now + 0.05) - now
            for key, _ in sel.select(max(wait, 0.0)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf, room = bufs[fd], caps[fd] - len(bufs[fd])
                buf += chunk[:max(room, 0)]
                if len(chunk) > room and fd != status_r and not overflow:
                    overflow = True
                    _kill_group(proc)
                    stop_at = time.monotonic() + _GRACE
    finally:
        sel.close()
    out, err = bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()])
    return out, err, bytes(bufs[status_r]), timed_out, overflow


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the child has exited, without reaping it (its pid, hence its group, stays reserved)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.returncode is None:             # not reaped yet: the group id cannot have been reused
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _result(proc, out: bytes, err: bytes, status_raw: bytes, timed_out: bool, overflow: bool,
            limits: Limits, isolate: bool) -> Result:
    try:
        status = json.loads(status_raw.decode() or "null")
    except ValueError:
        status = None
    stderr = err.decode("utf-8", "replace")
    if isinstance(status, dict) and "error" in status:
        raise SandboxUnavailable(f"the sandbox could not be set up: {status['error']}")
    if status is None and isolate and (proc.returncode or 0) > 0 and stderr.startswith("unshare:"):
        raise SandboxUnavailable(f"the sandbox could not be started: {stderr.strip().splitlines()[0]}")
    if isinstance(status, dict) and "signal" in status:
        returncode = -int(status["signal"])
    elif isinstance(status, dict):
        returncode = int(status.get("exit", 0))
    elif timed_out or overflow or not proc.returncode:
        returncode = -signal.SIGKILL        # killed before the bootstrap could report
    else:
        returncode = proc.returncode
    cpu = float(status.get("cpu", 0.0)) if isinstance(status, dict) else 0.0
    return Result(returncode, out.decode("utf-8", "replace"), stderr, timed_out,
                  _reason(returncode, stderr, timed_out, overflow, cpu, limits), isolate)


def _reason(returncode: int, stderr: str, timed_out: bool, overflow: bool, cpu: float, limits: Limits) -> str:
    if timed_out:
        return "wall timeout"
    if overflow:
        return "output limit"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and cpu >= limits.cpu_seconds):
        return "cpu limit"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "?"
        return f"killed by signal {-returncode} ({name})"
    if returncode == 0:
        return ""
    tail = stderr[-2000:]
    if "MemoryError" in tail:
        return "memory limit"
    if "File too large" in tail or "No space left on device" in tail:
        return "file size limit"
    if "BlockingIOError" in tail and "Resource temporarily unavailable" in tail:
        return "process limit"
    return f"exit status {returncode}"


# --- pids cgroup (only needed as root, where RLIMIT_NPROC is not enforced) -------------------

def _pids_cgroup_parent() -> str | None:
    """A writable cgroup directory where a child with a pids limit can be created, if any."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for fields in mounts:
        sep = fields.index("-")
        fstype, options, mountpoint = fields[sep + 1], fields[sep + 3].split(","), _unescape(fields[4])
        root = _unescape(fields[3])
        for _, controllers, path in memberships:
            if fstype == "cgroup" and "pids" in options and "pids" in controllers.split(","):
                pass
            elif fstype == "cgroup2" and controllers == "":
                try:
                    with open(os.path.join(mountpoint, _relative(path, root), "cgroup.subtree_control")) as f:
                        if "pids" not in f.read().split():
                            continue
                except OSError:
                    continue
            else:
                continue
            directory = os.path.join(mountpoint, _relative(path, root))
            if os.path.isdir(directory) and os.access(directory, os.W_OK):
                return directory
    return None


def _relative(path: str, root: str) -> str:
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    return path.lstrip("/")


def _make_pids_cgroup(max_tasks: int) -> str:
    parent = _pids_cgroup_parent()
    if parent is None:
        raise SandboxUnavailable("no writable pids cgroup to bound the processes of a root-run sandbox")
    path = os.path.join(parent, f"randkv-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_tasks))
    except OSError:
        _remove_cgroup(path)
        raise
    return path


def _remove_cgroup(path: str) -> None:
    for _ in range(100):                    # its last tasks may take a moment to be released
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _unescape(field: str) -> str:
    """Undo the octal escapes (\\040 for a space, ...) of /proc/self/mountinfo fields."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------------------------
# Child side: the bootstrap, run as `python -I -S sandbox.py --bootstrap CONFIG`
# --------------------------------------------------------------------------------------------

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 24, 36, 38
_DEVICES = ("null", "zero", "full", "random", "urandom")
_HIDDEN = ("/tmp", "/run", "/var/tmp", "/dev/shm")     # /tmp becomes the working directory


def _bootstrap(config: dict) -> None:
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    limits = Limits(**config["limits"])
    try:
        with open(os.path.join(config["work"], "prog.py"), "rb") as f:
            source = f.read()
        work = config["work"]
        if config["isolate"]:
            if config["cgroup"]:
                with open(os.path.join(config["cgroup"], "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            work = _isolate_filesystem(work, limits.file_bytes + len(source) + (4 << 20))
            with open(os.path.join(work, "prog.py"), "wb") as f:
                f.write(source)
        os.chdir(work)
        _apply_rlimits(limits, config["isolate"])
        if config["isolate"]:
            _drop_capabilities()
        else:
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)   # orphans come to us, even after a setsid
    except Exception as e:
        os.write(status_fd, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        os._exit(125)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
    python = config["python"]
    pid = os.fork()
    if pid == 0:
        try:
            os.execve(python, [python, *_PYTHON_FLAGS, "prog.py"], env)
        finally:
            os._exit(127)
    while True:                              # as pid 1 we also reap the program's orphans
        try:
            child, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if child == pid:
            break
    report = {"cpu": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit"] = os.WEXITSTATUS(status)
    os.write(status_fd, json.dumps(report).encode())
    if not config["isolate"]:
        _kill_descendants()
    os._exit(0)                              # pid 1 exiting kills whatever the program left behind


def _kill_descendants() -> None:
    """Without a pid namespace: SIGKILL our children until none are left (orphans reparent to us)."""
    me = str(os.getpid())
    for _ in range(1000):
        children = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        children.append(int(pid))
            except (OSError, IndexError):
                continue
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _apply_rlimits(limits: Limits, isolate: bool) -> None:
    import math
    import resource

    def cap(which: int, value: int, hard: int | None = None) -> None:
        _, old_hard = resource.getrlimit(which)
        hard = value if hard is None else hard
        if old_hard != resource.RLIM_INFINITY:
            value, hard = min(value, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (value, hard))

    cpu = max(1, math.ceil(limits.cpu_seconds))
    cap(resource.RLIMIT_CPU, cpu, cpu + 1)
    cap(resource.RLIMIT_AS, limits.memory_bytes)
    cap(resource.RLIMIT_FSIZE, limits.file_bytes)
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NOFILE, 256)
    # RLIMIT_NPROC counts the tasks of the real uid: in the user namespace, the unshare process,
    # this bootstrap and the program's; without one, every task of the caller's uid.
    base = 2 if isolate else _tasks_of_uid(os.getuid())
    cap(resource.RLIMIT_NPROC, base + limits.processes)


def _tasks_of_uid(uid: int) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _isolate_filesystem(host_work: str, size: int) -> str:
    """Make every mount read-only except a fresh tmpfs working directory, whose path is returned."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mount {target}: {os.strerror(errno)}")

    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    needed = {os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix,
                                            sys.base_exec_prefix, os.path.dirname(os.__file__))}
    needed.add(os.path.abspath(sys.executable))

    def hideable(path: str) -> bool:
        if os.path.islink(path) or not os.path.isdir(path):
            return False
        real = os.path.realpath(path)
        return not any(p == real or p.startswith(real.rstrip("/") + "/") for p in needed)

    hidden = [p for p in _HIDDEN if hideable(p)]
    work = "/tmp" if "/tmp" in hidden else host_work
    mount("tmpfs", work, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},nr_inodes=4096,mode=700")
    for path in hidden:
        if path != work:
            mount("tmpfs", path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,mode=755")
    devices = [f"/dev/{d}" for d in _DEVICES if os.path.exists(f"/dev/{d}")]
    for device in devices:
        mount(device, device, None, _MS_BIND)

    def visible_mounts() -> list[tuple[str, list[str]]]:
        with open("/proc/self/mountinfo") as f:
            entries = [(_unescape(line.split()[4]), line.split()[5].split(",")) for line in f]
        # A mount is hidden if a later one sits on its mount point or on a directory above it.
        return [(point, opts) for i, (point, opts) in enumerate(entries)
                if not any(later == point or point.startswith(later.rstrip("/") + "/")
                           for later, _ in entries[i + 1:])]

    for point, opts in visible_mounts():
        if point == work:
            continue
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID
        flags |= 0 if point in devices else _MS_NODEV
        flags |= _MS_NOEXEC if "noexec" in opts else 0
        mount(None, point, None, flags)
    writable = [point for point, opts in visible_mounts() if point != work and "ro" not in opts]
    if writable:
        raise OSError(f"mounts still writable: {writable}")
    return work


def _drop_capabilities() -> None:
    """Empty the bounding set, so the exec'd program (uid 0 in the namespace) gets no capability."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def _prctl(option: int, value: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}): {os.strerror(errno)}")


if __name__ == "__main__" and sys.argv[1:2] == ["--bootstrap"]:
    _bootstrap(json.loads(sys.argv[2]))
