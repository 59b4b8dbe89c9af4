"""Faults a test or a chapter injects into a running engine worker, through a file.

`labkit serve --fault-file PATH` makes every worker read PATH (one word per line) when it
starts and before each engine step; a missing file means no fault. The words:

    fail-start   the worker raises while it builds its engine (a start that fails)
    raise-step   each engine step raises (the core fails the step's requests and goes on)
    hang-step    each engine step blocks until the word is gone (a worker that is alive,
                 answers signals, and does not advance: what the hang detector must catch)
    crash-step   the first engine step with work kills the worker process (`SIGKILL` to
                 itself: a crash in a kernel, which no `except` sees)

A signal needs no file: `SIGSTOP` freezes a worker, `SIGKILL` ends it. The file is read
with one `stat` per step when nothing is injected, so leaving the option on costs nothing
measurable; without the option the worker never looks.
"""

from __future__ import annotations

import os
import signal
import time

FAULTS = ("fail-start", "raise-step", "hang-step", "crash-step")


class InjectedFault(RuntimeError):
    """Raised where a fault file asks for a failure."""


class FaultFile:
    def __init__(self, path: str):
        self.path = path

    def active(self) -> set[str]:
        try:
            with open(self.path, encoding="utf-8") as file:
                words = set(file.read().split())
        except FileNotFoundError:
            return set()
        unknown = words - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)} in {self.path}; known: {FAULTS}")
        return words

    def check_start(self) -> None:
        if "fail-start" in self.active():
            raise InjectedFault(f"fail-start injected by {self.path}")

    def wrap_step(self, step, has_work=lambda: True):
        """`step` with the file's step faults applied before each call; `has_work` tells a
        step with work from the idle ones the worker runs between commands."""

        def faulty_step():
            faults = self.active()
            while "hang-step" in faults:
                time.sleep(0.05)
                faults = self.active()
            if "raise-step" in faults:
                raise InjectedFault(f"raise-step injected by {self.path}")
            if "crash-step" in faults and has_work():
                os.kill(os.getpid(), signal.SIGKILL)
            return step()

        return faulty_step


def write_faults(path: str, *faults: str) -> None:
    """Inject `faults` (none: clear them) for a worker started with `--fault-file path`."""
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {FAULTS}")
    if not faults:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        file.write("\n".join(faults) + "\n")
    os.replace(temporary, path)  # a worker reads all of it or none of it
