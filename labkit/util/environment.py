"""What a measurement ran on: the record every results file carries.

``capture()`` returns a plain, JSON-serialisable dict: Python and platform, the CPU model
and its vector extensions, its caches and a measured memory read rate, logical cores and the cores this process may use, memory,
torch's thread counts and parallel backends (OpenMP, MKL, oneDNN), library versions,
CUDA, the git revision of the repository (and whether the working tree differs from it),
and, when given one, the record of the model's weight file (its sha256, where it comes from).

It records nothing personal: no hostname, user name, home folder or IP address.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from labkit.util.machine import ISA_NAMES, machine_record

LIBRARIES = ("torch", "transformers", "tokenizers", "gguf", "numpy", "safetensors", "labkit")

# Files a run itself rewrites: a change there does not make the code differ from the revision.
DIRTY_IGNORE = (":(exclude)results", ":(exclude)notebooks/*.ipynb")



def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_info() -> dict[str, Any]:
    """CPU model and the vector extensions that matter for our kernels (Linux /proc/cpuinfo)."""
    model = None
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if model is None and key in ("model name", "hardware", "cpu model"):
            model = value.strip()
        elif not flags and key in ("flags", "features"):
            flags = set(value.split())
    if model is None:
        model = platform.processor() or None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "model": model,
        "machine": platform.machine(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "isa": [flag for flag in ISA_NAMES if flag in flags],
        # Other work on the machine while the record was made: a run taken beside another
        # timing job is not evidence, and this is how a reader can tell.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def memory_info() -> dict[str, Any]:
    try:
        import psutil

        return {"total_bytes": int(psutil.virtual_memory().total)}
    except Exception:  # psutil missing or unsupported platform
        return {"total_bytes": None}


def _parallel_summary(text: str) -> dict[str, Any]:
    """The useful lines of ``torch.__config__.parallel_info()``."""
    summary: dict[str, Any] = {"backend": None, "openmp": None, "mkl": None, "onednn": None}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("ATen parallel backend:"):
            summary["backend"] = line.split(":", 1)[1].strip()
        elif line.startswith("OpenMP"):
            summary["openmp"] = line
        elif "Math Kernel Library" in line or line.startswith("Intel(R) MKL "):
            match = re.search(r"Version\s+([0-9][0-9.]*)", line)
            summary["mkl"] = match.group(1) if match else line
        elif "MKL-DNN" in line or "oneDNN" in line:
            match = re.search(r"v(\d[\w.]*)", line)
            summary["onednn"] = match.group(1) if match else line
    return summary


def torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"available": False}
    info: dict[str, Any] = {
        "available": True,
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "mkl_available": bool(torch.backends.mkl.is_available()),
        "openmp_available": bool(getattr(torch.backends, "openmp", None)
                                 and torch.backends.openmp.is_available()),
        "parallel": _parallel_summary(torch.__config__.parallel_info()),
        "env": {name: os.environ.get(name) for name in
                ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")},
    }
    cuda = torch.cuda.is_available()
    info["cuda"] = {
        "available": cuda,
        "version": torch.version.cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
    }
    return info


def find_git_root(start: str | os.PathLike | None = None) -> Path | None:
    """The nearest folder at or above ``start`` (default: the working directory, then the
    folder that holds the labkit package) that contains ``.git``."""
    starts = [Path(start or Path.cwd()).resolve(), Path(__file__).resolve().parent]
    for begin in starts:
        for folder in (begin, *begin.parents):
            if (folder / ".git").exists():
                return folder
    return None


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), *args],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _revision_from_files(root: Path) -> str | None:
    """Read HEAD without the git executable (a plain .git folder)."""
    git_dir = root / ".git"
    try:
        head = (git_dir / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    ref_file = git_dir / ref
    if ref_file.is_file():
        return ref_file.read_text().strip() or None
    packed = git_dir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None  # a repository without commits yet


def git_info(start: str | os.PathLike | None = None) -> dict[str, Any]:
    """Revision of the repository and whether tracked files differ from it.

    ``dirty`` ignores ``results/`` and the stored notebook outputs (``notebooks/*.ipynb``),
    which a run rewrites itself; ``dirty_files`` lists up to 20 changed paths.
    ``revision`` is ``None`` outside a repository or before the first commit.
    """
    root = find_git_root(start)
    if root is None:
        return {"revision": None, "dirty": None, "dirty_files": []}
    out = _git(root, "rev-parse", "HEAD")
    revision = out.strip() if out else _revision_from_files(root)
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *DIRTY_IGNORE)
    if status is None:
        dirty, files = None, []
    else:
        files = [line[3:] for line in status.splitlines() if line.strip()]
        dirty = bool(files)
    return {"revision": revision, "dirty": dirty, "dirty_files": files[:20]}


def capture(model: dict[str, Any] | None = None, *, root: str | os.PathLike | None = None,
            measure: bool = True) -> dict[str, Any]:
    """The environment record attached to every result (JSON-serialisable, no personal data).
    `model` is the model's artefact record (`labkit.models.registry.artefact_record`): this
    module sits below the models and knows nothing of them. `machine` holds the caches, the
    ISA flags and (with `measure`, once per process) the measured memory read rate
    (`labkit.util.machine`)."""
    env: dict[str, Any] = {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable_prefix_is_venv": sys.prefix != sys.base_prefix,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "libc": "-".join(platform.libc_ver()) or None,
        },
        "cpu": cpu_info(),
        "machine": machine_record(measure),
        "memory": memory_info(),
        "torch": torch_info(),
        "versions": {name: _version(name) for name in LIBRARIES},
        "git": git_info(root),
    }
    if model is not None:
        env["model"] = dict(model)
    return env


__all__ = ["capture", "cpu_info", "torch_info", "git_info", "find_git_root"]
