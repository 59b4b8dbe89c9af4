"""Run a tool's process confined (`confine.py`), under limits, and say how it ended.

    Sandbox(limits).run(argv, stdin)      -> ToolResult
    Sandbox(limits).run_python(code, stdin) -> ToolResult   (the interpreter's standard library only)

The caller's side of a run: a scratch directory of the run's own (removed afterwards), the
launcher started with an empty environment in a session of its own, stdin fed from a thread,
stdout and stderr read together up to `Limits.output_bytes`, and the whole process group
killed with SIGKILL at the wall-clock limit or past the output limit. Killing the group kills
the namespace's pid 1, and the kernel then kills every process in the namespace, including
any that left the group. The launcher first drops the run to the lowest CPU priority (nice 19,
SCHED_IDLE where the kernel allows, and its session's autogroup nice 19;
`confine.lowest_priority`), so a tool that spins or forks takes the cores mostly when nothing
else, the server included, wants them. How it ended
becomes one `ErrorKind`, from the launcher's status pipe (which the tool cannot write) and
what this side saw, never from the tool's own words (one exception, said at MEMORY_EXIT_CODE).
"""

from __future__ import annotations

import json
import os
import platform
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from labkit.agent import confine

CONFINE_SCRIPT = Path(confine.__file__).resolve()
# Namespace roots of privileged launches map to a fresh uid in this range, outside any the
# host's users or subordinate-id ranges are likely to hold.
RUN_UID_BASE, RUN_UID_SPAN = 1_500_000_000, 1 << 24
# run_python's interpreter exits with this when the code raised MemoryError (RLIMIT_AS refused
# an allocation). The code could exit with it too; it would only mislabel its own result.
MEMORY_EXIT_CODE = 86
PYTHON_RUNNER = f"""
import os, sys
source = sys.argv[1]
try:
    exec(compile(source, "<tool>", "exec"), {{"__name__": "__main__"}})
except MemoryError:
    sys.stderr.write("MemoryError: allocation refused by the memory limit\\n")
    sys.stderr.flush()
    os._exit({MEMORY_EXIT_CODE})
"""


class SandboxUnavailable(RuntimeError):
    """This machine (kernel, container, platform) does not allow the confinement; says why."""


class ErrorKind(str, Enum):
    TIMEOUT = "timeout"              # the wall-clock limit: the run was killed
    CPU = "cpu"                      # RLIMIT_CPU: SIGXCPU, or SIGKILL at the hard limit
    MEMORY = "memory"                # RLIMIT_AS refused an allocation
    OUTPUT_LIMIT = "output_limit"    # stdout + stderr past Limits.output_bytes, or a file past file_bytes
    CRASHED = "crashed"              # a non-zero exit or another signal
    REFUSED = "refused"              # not on the allow-list (tools.ToolRegistry); the sandbox did not start
    BAD_ARGUMENTS = "bad_arguments"  # arguments not valid for the tool (tools.ToolRegistry, the tool itself)


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 << 20   # address space, per process
    nproc: int = 32                 # processes and threads of the run's uid
    file_bytes: int = 16 << 20      # largest file the tool may write
    nofile: int = 64
    output_bytes: int = 64 << 10    # stdout and stderr together
    tmp_bytes: int = 16 << 20       # the private tmpfs at /tmp


@dataclass
class ToolResult:
    ok: bool
    output: str
    error: ErrorKind | None = None
    detail: str = ""                 # why it failed, or the tool's stderr
    exit_code: int | None = None
    signal: int | None = None
    elapsed_s: float = 0.0
    cpu_s: float | None = None       # CPU time the run had had when the wall clock killed it

    @classmethod
    def success(cls, output: str, **fields) -> ToolResult:
        return cls(True, output, **fields)

    @classmethod
    def failure(cls, error: ErrorKind, detail: str, output: str = "", **fields) -> ToolResult:
        return cls(False, output, error, detail, **fields)


def default_ro_paths() -> list[str]:
    """What a tool may read: the system's programs and libraries, and this Python's prefix."""
    paths = ["/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/ld.so.cache", "/etc/alternatives"]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
        paths.append(prefix)
    return paths


def tasks_of(uid: int) -> int:
    """Processes and threads the uid runs now (RLIMIT_NPROC counts them all)."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                continue
    return count


class Sandbox:
    def __init__(self, limits: Limits = Limits(), ro_paths: list[str] | None = None, seccomp: bool = True):
        self.limits = limits
        self.ro_paths = ro_paths if ro_paths is not None else default_ro_paths()
        self.seccomp = seccomp
        self.python = os.path.realpath(sys.executable)
        self.last_seccomp = ""  # what the last run's launcher said of the filter
        self.last_priority = ""  # ... and of the CPU priority (nice, scheduling policy)

    @staticmethod
    def check_platform() -> None:
        if sys.platform != "linux":
            raise SandboxUnavailable(f"the sandbox needs Linux namespaces; this is {sys.platform}")
        if platform.machine() not in confine.SYS_PIVOT_ROOT:
            raise SandboxUnavailable(f"pivot_root's number is not known on {platform.machine()}")

    def probe(self) -> str:
        """Start one confined no-op; SandboxUnavailable with the launcher's reason if it cannot.
        Returns what it said of the seccomp filter and of the CPU priority."""
        self.check_platform()
        result = self.run(["/bin/sh", "-c", "exit 0"])
        if not result.ok:
            raise SandboxUnavailable(result.detail or str(result.error))
        return f"seccomp {self.last_seccomp}; CPU priority {self.last_priority}"

    def run_python(self, code: str, stdin: bytes = b"") -> ToolResult:
        result = self.run([self.python, "-I", "-S", "-c", PYTHON_RUNNER, code], stdin)
        if result.exit_code == MEMORY_EXIT_CODE and "MemoryError" in result.detail:
            result.error = ErrorKind.MEMORY
        return result

    def run(self, argv: list[str], stdin: bytes = b"") -> ToolResult:
        self.check_platform()
        workdir = Path(tempfile.mkdtemp(prefix="labkit-sandbox-"))
        try:
            return self.run_in(workdir, argv, stdin)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def run_in(self, workdir: Path, argv: list[str], stdin: bytes) -> ToolResult:
        workdir.chmod(0o755)
        (workdir / "root").mkdir()
        scratch = workdir / "scratch"
        scratch.mkdir(mode=0o700)
        privileged = os.geteuid() == 0
        limits = self.limits
        if privileged:
            uid = gid = RUN_UID_BASE + random.randrange(RUN_UID_SPAN)
            os.chown(scratch, uid, gid)
            nproc = limits.nproc
        else:
            uid, gid = os.getuid(), os.getgid()
            nproc = limits.nproc + tasks_of(uid)  # the limit counts the user's other processes too
        status_r, status_w = os.pipe()
        config = {"argv": argv, "root": str(workdir / "root"), "scratch": str(scratch),
                  "ro_paths": self.ro_paths, "uid": uid, "gid": gid, "privileged": privileged,
                  "status_fd": status_w, "seccomp": self.seccomp, "tmp_bytes": limits.tmp_bytes,
                  "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "nproc": nproc,
                             "file_bytes": limits.file_bytes, "nofile": limits.nofile}}
        config_file = workdir / "config.json"
        config_file.touch(mode=0o600)
        config_file.write_text(json.dumps(config))
        start = time.monotonic()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(CONFINE_SCRIPT), str(config_file)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={}, pass_fds=(status_w,), start_new_session=True, cwd="/")
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        feeder = threading.Thread(target=feed, args=(proc.stdin, stdin), daemon=True)
        feeder.start()
        ending = Collector(proc, status_r, limits).collect(start + limits.wall_s)
        feeder.join(timeout=1)
        return self.classify(ending, time.monotonic() - start)

    def classify(self, ending: Ending, elapsed: float) -> ToolResult:
        status = {}
        for line in ending.status.decode(errors="replace").splitlines():
            try:  # each line is one write under PIPE_BUF: whole, unless the launcher was killed in it
                status.update(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.last_seccomp = status.get("seccomp", "")
        self.last_priority = status.get("priority", "")
        out = ending.stdout.decode(errors="replace")
        err = ending.stderr.decode(errors="replace")
        fields = {"exit_code": status.get("exit"), "signal": status.get("signal"), "elapsed_s": elapsed,
                  "cpu_s": ending.cpu_s}
        if ending.timed_out:
            # The run is at the lowest CPU priority: on a busy machine it may have had next to
            # no CPU in its wall-clock time, and the caller should be able to tell.
            return ToolResult.failure(ErrorKind.TIMEOUT, f"killed at the wall-clock limit "
                                      f"({self.limits.wall_s} s) after {ending.cpu_s:.2f} s of CPU time",
                                      out, **fields)
        if ending.over_output:
            return ToolResult.failure(ErrorKind.OUTPUT_LIMIT, f"killed past {self.limits.output_bytes} "
                                      "bytes of output", out, **fields)
        if "setup_error" in status:
            return ToolResult.failure(ErrorKind.REFUSED,
                                      f"the sandbox did not start: {status['setup_error']}", out, **fields)
        sig = status.get("signal")
        if sig in (signal.SIGXCPU, signal.SIGKILL):  # nobody but RLIMIT_CPU kills it with these
            return ToolResult.failure(ErrorKind.CPU, f"killed at the CPU-time limit ({self.limits.cpu_s} s)",
                                      out, **fields)
        if sig == signal.SIGXFSZ:
            return ToolResult.failure(ErrorKind.OUTPUT_LIMIT, f"a file past {self.limits.file_bytes} bytes",
                                      out, **fields)
        if sig is not None:
            return ToolResult.failure(ErrorKind.CRASHED, f"killed by {signal.Signals(sig).name}\n{err}",
                                      out, **fields)
        if status.get("exit") is None:
            return ToolResult.failure(ErrorKind.CRASHED, f"the launcher ended without a status "
                                      f"(exit {ending.returncode})\n{err}", out, **fields)
        if status["exit"] != 0:
            return ToolResult.failure(ErrorKind.CRASHED, f"exit code {status['exit']}\n{err}", out, **fields)
        return ToolResult.success(out, detail=err, **fields)


def feed(pipe, data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass  # the tool did not read it all: its business


def process_stats():
    """(pid, /proc/PID/stat fields from the state on) of every process still readable."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            yield int(name), Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user and system, its reaped children's included) that process `root` and
    every live process under it have had, read from /proc."""
    parents, used = {}, {}
    for pid, fields in process_stats():
        parents[pid] = int(fields[1])  # fields from the state on: ppid, ..., utime at 11
        used[pid] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(used.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def all_zombies(pgid: int) -> bool:
    """Whether every process left in the group has exited (zombies wait for a reaper)."""
    return all(int(fields[2]) != pgid or fields[0] == "Z" for _, fields in process_stats())  # pgrp, state


@dataclass
class Ending:
    stdout: bytes
    stderr: bytes
    status: bytes
    returncode: int
    timed_out: bool
    over_output: bool
    cpu_s: float | None = None  # measured only when the wall clock ran out


class Collector:
    """Read stdout, stderr and the status pipe together until all close, the deadline passes
    (kill) or the output passes its limit (kill)."""

    def __init__(self, proc: subprocess.Popen, status_fd: int, limits: Limits):
        self.proc, self.status_fd, self.limits = proc, status_fd, limits

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait_for_group(self, timeout: float = 5.0) -> None:
        """After a kill: the launcher died at once, but the namespace's pid 1 exits only once the
        kernel has killed and reaped every process in it. Wait for that (bounded), so that
        nothing of the run is alive when `run` returns."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            if all_zombies(self.proc.pid):
                return
            time.sleep(0.02)

    def collect(self, deadline: float) -> Ending:
        chunks = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
        selector.register(self.proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
        selector.register(self.status_fd, selectors.EVENT_READ, "status")
        timed_out = over_output = False
        cpu_s = None
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    cpu_s = tree_cpu_seconds(self.proc.pid)
                    break
                for key, _ in selector.select(timeout=left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    chunks[key.data] += data
                if len(chunks["stdout"]) + len(chunks["stderr"]) > self.limits.output_bytes:
                    over_output = True
                    break
        finally:
            if timed_out or over_output:
                self.kill()
            returncode = self.proc.wait()  # the launcher waits for the namespace's pid 1, so
            # once it is gone the kernel has killed every process the tool left behind
            if timed_out or over_output:
                self.wait_for_group()
            selector.close()
            os.close(self.status_fd)
            self.proc.stdout.close()
            self.proc.stderr.close()
        cap = self.limits.output_bytes
        return Ending(bytes(chunks["stdout"][:cap]), bytes(chunks["stderr"][:cap]), bytes(chunks["status"]),
                      returncode, timed_out, over_output, cpu_s)
