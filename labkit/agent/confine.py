"""The confinement a tool's process runs under (Linux), applied in the child before exec.

This file runs as a script in a fresh interpreter (`python -I -S confine.py CONFIG_FILE`, started
by `sandbox.Sandbox` with an empty environment), so it uses the standard library only and
its process starts single-threaded: nothing here runs in the server's own (threaded) process.

    P0 launcher (outside)        drops to the lowest CPU priority (inherited by all below);
                                 forks P1; writes P1's uid/gid map (one id: the run's own)
    P1 unshare(user, mount, net, ipc, uts, pid); opens what it will bind; becomes uid 0 *of its
       namespace only*; builds a new root on a tmpfs: read-only binds of /usr and the
       interpreter, /dev/null, /dev/zero, /dev/urandom, a small tmpfs /tmp, the scratch
       directory read-write; forks
    P2 pid 1 of the new pid namespace: mounts a fresh /proc, pivot_root, remounts / read-only,
       forks the tool and reaps; when it exits the kernel kills whatever the tool left behind
    P3 the tool: caps dropped (bounding set, ambient, capset), PR_SET_NO_NEW_PRIVS, a seccomp
       filter (where libseccomp is present), rlimits, an environment of three fixed names, exec

Why the run has an outer uid of its own: RLIMIT_NPROC counts the processes of a real uid and
does not bind root, so a tool that ran as root (even root of a user namespace mapped to root)
could fork without bound. When the launcher is root, each run's namespace root is mapped to a
fresh unprivileged uid (`config["uid"]`), which owns nothing on the host but the scratch
directory; as another user, to that user itself (RLIMIT_NPROC then also counts the user's
other processes, which the caller adds to the limit).

The new network namespace has only a loopback device that is down: connect() to 127.0.0.1
and to any outside address fails with ENETUNREACH; seccomp also refuses socket() for any
family but AF_UNIX. P2 writes JSON lines to the status pipe (fd `config["status_fd"]`, closed
on exec, so the tool cannot forge them): the tool's exit code or signal, or why setup failed.

Why the lowest CPU priority: the rlimits bound a run's CPU *time*, not its share of the cores
while it uses that time, and a fork bomb's processes or a busy loop would otherwise take the
cores from the server that runs the model (chapter 34 saw it answer nothing for the 4 s of an
attack). So P0 sets its autogroup's nice to 19 (the kernel shares cores between session groups
before it looks at a task's nice), nice 19 and, where the kernel allows, SCHED_IDLE (a very
small weight: it runs mostly on cores that nothing else wants) before anything else; every
process of the run inherits both, and RLIMIT_NICE 0 keeps the tool from climbing back. A cgroup
would cap the share outright, but a process in a container rarely may make one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import platform
import resource
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP = 0x02000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits -> the mount flags a user namespace must keep on a remount (they are locked)
LOCKED_FLAGS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME,
                2048: MS_NODIRATIME, 4096: MS_RELATIME}

PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

# The tool's whole environment: fixed names, none taken from whoever started it.
TOOL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/tmp",
            "LANG": "C.UTF-8"}
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")

# Refused with EPERM by the seccomp filter, besides socket() of any family but AF_UNIX: the
# namespace and mount calls (a tool has no business making its own), tracing other processes,
# kernel keyrings, BPF, modules, and the kernel interfaces with a record of privilege escalations.
DENIED_SYSCALLS = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root",
                   "chroot", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf",
                   "perf_event_open", "userfaultfd", "io_uring_setup", "open_by_handle_at",
                   "name_to_handle_at", "kexec_load", "kexec_file_load", "init_module", "finit_module",
                   "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl", "clone3")
AF_UNIX = 1
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO = 0x7FFF0000, 0x00050000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7


class ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None):
    enc = (lambda s: s.encode() if s is not None else None)
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source} on {target}")


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def map_ids(pid: int, inner_uid: int, outer_uid: int, outer_gid: int, privileged: bool) -> None:
    """Write `pid`'s user-namespace maps: its uid/gid `inner_uid` is `outer_uid`/`outer_gid`
    outside, and no other id exists there. Unprivileged, setgroups must be denied first."""
    if not privileged:
        write_file(f"/proc/{pid}/setgroups", "deny")
    write_file(f"/proc/{pid}/uid_map", f"{inner_uid} {outer_uid} 1\n")
    write_file(f"/proc/{pid}/gid_map", f"{inner_uid} {outer_gid} 1\n")


def open_sources(config: dict) -> dict[str, int | str]:
    """Every path to bind, opened (O_PATH) while still the host's uid: the paths may pass
    through directories only the launcher's user can enter (/root/.pyenv for the interpreter),
    which the run's uid could not. A link (/bin -> usr/bin) is kept as its target text."""
    sources: dict[str, int | str] = {}
    for path in [*config["ro_paths"], *DEVICES, config["scratch"]]:
        if os.path.islink(path) and path in config["ro_paths"]:
            sources[path] = os.readlink(path)
        elif os.path.exists(path):
            sources[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
    return sources


def bind(fd: int, target: str, writable: bool) -> None:
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    if not writable:
        kept = 0
        flag = os.statvfs(fd).f_flag
        for bit, ms in LOCKED_FLAGS.items():
            kept |= ms if flag & bit else 0
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def build_root(config: dict, sources: dict[str, int | str]) -> None:
    """In the new mount namespace: a tmpfs root holding only what the tool needs."""
    root = config["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, source in sources.items():
        if path == config["scratch"]:
            continue
        inside = root + path
        if isinstance(source, str):
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(source, inside)
        else:
            bind(source, inside, writable=path in DEVICES)
            os.close(source)
    os.makedirs(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['tmp_bytes']},mode=1777")
    bind(sources[config["scratch"]], root + "/scratch", writable=True)
    os.close(sources[config["scratch"]])
    os.makedirs(root + "/proc")
    os.makedirs(root + "/.old")


def enter_root(root: str) -> None:
    """As pid 1 of the new pid namespace: its own /proc, then the new root replaces the old."""
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b".old"), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_capabilities() -> None:
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop bounding capability")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    data = (CapData * 2)()
    check(libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def load_seccomp() -> str:
    """Install the filter; returns what was done (libseccomp may be absent: then say so)."""
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return "not applied: libseccomp not found"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    deny = SCMP_ACT_ERRNO | errno.EPERM

    def rule(syscall: str, *compares: ArgCmp) -> None:
        number = lib.seccomp_syscall_resolve_name(syscall.encode())
        if number < 0:
            return  # not a syscall on this architecture
        array = (ArgCmp * max(1, len(compares)))(*compares)
        code = lib.seccomp_rule_add_array(ctypes.c_void_p(ctx), deny, number, len(compares), array)
        if code < 0:
            raise OSError(-code, f"seccomp rule for {syscall}: {os.strerror(-code)}")

    for syscall in DENIED_SYSCALLS:
        rule(syscall)
    rule("socket", ArgCmp(0, SCMP_CMP_NE, AF_UNIX, 0))
    for flag in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWIPC, CLONE_NEWUTS,
                 CLONE_NEWCGROUP):
        rule("clone", ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
    code = lib.seccomp_load(ctypes.c_void_p(ctx))
    if code < 0:
        raise OSError(-code, f"seccomp_load: {os.strerror(-code)}")
    return f"applied: {len(DENIED_SYSCALLS)} calls and non-AF_UNIX socket() refused"


def set_limits(limits: dict) -> None:
    cpu = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    for name, key in (("RLIMIT_AS", "memory_bytes"), ("RLIMIT_NPROC", "nproc"),
                      ("RLIMIT_FSIZE", "file_bytes"), ("RLIMIT_NOFILE", "nofile")):
        resource.setrlimit(getattr(resource, name), (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))  # no way back from nice 19 or SCHED_IDLE


def lowest_priority() -> str:
    """nice 19 and SCHED_IDLE for this process (and so for all it starts), and nice 19 for its
    autogroup; says what was applied."""
    applied, refused = [], []
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # raising one's own nice needs no privilege
        applied.append(f"nice {os.getpriority(os.PRIO_PROCESS, 0)}")
    except OSError as e:
        refused.append(f"nice 19 ({e.strerror})")
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        applied.append("SCHED_IDLE")
    except (OSError, AttributeError) as e:  # AttributeError: a Python built without it
        refused.append(f"SCHED_IDLE ({getattr(e, 'strerror', None) or e})")
    # Where the kernel groups tasks by session (sched_autogroup_enabled), this run's new
    # session is a group of its own that the scheduler shares the cores with *as a peer* of the
    # server's group, whatever its tasks' nice or policy: six runs at once held the server to a
    # seventh of them. The group's own nice (raising it needs no privilege) lowers its weight.
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
        applied.append("autogroup nice 19")
    except FileNotFoundError:
        pass  # a kernel without autogroups: the task's own priority is all there is
    except OSError as e:
        refused.append(f"autogroup nice 19 ({e.strerror})")
    text = "applied: " + (", ".join(applied) or "nothing")
    return text + ("; refused: " + ", ".join(refused) if refused else "")


def report(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def run_tool(config: dict) -> None:
    """P3: the last steps before exec. Never returns."""
    fd = config["status_fd"]
    try:
        os.chdir("/scratch")
        drop_capabilities()
        seccomp = load_seccomp() if config["seccomp"] else "not applied: turned off"
        set_limits(config["limits"])
        report(fd, stage="exec", seccomp=seccomp)
        os.execve(config["argv"][0], config["argv"], TOOL_ENV)
    except BaseException as e:  # noqa: BLE001 - anything here is a setup failure, said as such
        report(fd, setup_error=f"tool setup: {e}")
    os._exit(125)


def init(config: dict) -> None:
    """P2, pid 1 of the namespace: enter the new root, start the tool, reap, report. Never returns."""
    fd = config["status_fd"]
    try:
        enter_root(config["root"])
        libc.sethostname(b"sandbox", 7)
    except BaseException as e:  # noqa: BLE001
        report(fd, setup_error=f"namespace init: {e}")
        os._exit(125)
    tool = os.fork()
    if tool == 0:
        run_tool(config)
    while True:  # reap everything (orphans come to pid 1) until the tool itself ends
        pid, status = os.wait()
        if pid == tool:
            break
    if os.WIFSIGNALED(status):
        report(fd, signal=os.WTERMSIG(status))
    else:
        report(fd, exit=os.WEXITSTATUS(status))
    os._exit(0)


def namespaced(config: dict, ready_w: int, mapped_r: int) -> None:
    """P1: unshare, wait for the id maps, build the root, become the namespace's uid 0. Never returns."""
    fd = config["status_fd"]
    try:
        check(libc.unshare(NAMESPACES), "unshare(user, mount, net, ipc, uts, pid)")
        os.write(ready_w, b"u")
        if os.read(mapped_r, 1) != b"m":
            raise OSError("the launcher could not write the id maps")
        sources = open_sources(config)  # still the host's uid
        if config["privileged"]:
            os.setgroups([])
        os.setresgid(0, 0, 0)  # from here on the run's own uid outside
        os.setresuid(0, 0, 0)
        build_root(config, sources)
    except BaseException as e:  # noqa: BLE001
        report(fd, setup_error=f"namespaces: {e}")
        os._exit(125)
    child = os.fork()  # the first child of an unshare(CLONE_NEWPID) is the new namespace's pid 1
    if child == 0:
        init(config)
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:  # a file outside the new root: the tool never sees its config
        config = json.load(f)
    fd = config["status_fd"]
    os.set_inheritable(fd, False)  # forks keep it; the tool's exec does not
    report(fd, priority=lowest_priority())  # first: the setup below runs at that priority too
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    child = os.fork()
    if child == 0:
        namespaced(config, ready_w, mapped_r)
    if os.read(ready_r, 1) == b"u":
        try:
            map_ids(child, 0, config["uid"], config["gid"], config["privileged"])
            os.write(mapped_w, b"m")
        except OSError as e:
            report(fd, setup_error=f"id maps: {e}")
    os.close(mapped_w)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) & 0xFF


if __name__ == "__main__":
    sys.exit(main(sys.argv))
