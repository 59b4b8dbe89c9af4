"""`labkit book stale`: chapters whose stored record predates a change to what made it.

A chapter's record is ``results/chNN/metrics.json``, whose ``git_revision`` names the commit
the chapter ran at. Its inputs are its code cells and the labkit modules and files they use
(:mod:`labkit.book.chapter_inputs`). The record is stale when a commit after that revision
changed an input (for the ``.md`` source, a change to its code cells; prose does not change
outputs), or when the revision is not an ancestor of ``HEAD`` (the record was made from code
this history does not hold). Only commits count: uncommitted edits are not a record's
concern until they are committed (CI checks a clean clone).

Excuses live in :data:`ALLOW_FILE` (TOML), reviewed like code, each with its reason:

* ``[[allow]]`` entries name a chapter and the commits and/or files they excuse. An entry
  that excuses nothing any more is an error, so the list only holds live excuses.
* ``[pending_rerun]`` lists chapters known stale that an issue will re-run: tolerated, but
  printed loudly; a listed chapter that is fresh again is an error (take it off the list).
"""

from __future__ import annotations

import json
import subprocess
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from labkit.book.chapter_inputs import ChapterInputs, Repository
from labkit.book.profile import PARAMETERS_SOURCE, is_install_cell

ALLOW_FILE = "results/stale-allowed.toml"
RECORD = "results/ch{number:02d}/metrics.json"
# Exit statuses: fresh (or excused), stale or a bad allow-list, no checkout, no history.
EXIT_OK, EXIT_STALE, EXIT_NOT_A_CHECKOUT, EXIT_NO_HISTORY = 0, 1, 3, 4
_ALLOW_KEYS, _PENDING_KEYS = {"chapter", "commits", "files", "reason"}, {"issue", "reason", "chapters"}


class NoHistory(Exception):
    """The git history needed to judge the records is not here."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Cause:
    """One commit after a record's revision that changed some of the chapter's inputs."""

    commit: str            # full hash ("" for a cause with no single commit)
    subject: str
    files: tuple[str, ...]

    @property
    def short(self) -> str:
        return self.commit[:7] if self.commit else "-------"


@dataclass
class ChapterState:
    number: int
    source: str
    revision: str | None = None       # the record's git_revision; None: no record
    causes: list[Cause] = field(default_factory=list)    # unexcused
    excused: list[tuple[Cause, "AllowEntry"]] = field(default_factory=list)
    pending: bool = False

    @property
    def stale(self) -> bool:
        return bool(self.causes)


@dataclass(frozen=True)
class AllowEntry:
    chapter: int
    commits: tuple[str, ...]
    files: tuple[str, ...]
    reason: str

    def excuses(self, commit: str, file: str) -> bool:
        by_commit = not self.commits or any(commit.startswith(c) for c in self.commits)
        return by_commit and (not self.files or file in self.files)


@dataclass(frozen=True)
class AllowList:
    entries: tuple[AllowEntry, ...] = ()
    pending: tuple[int, ...] = ()
    pending_issue: int | None = None
    pending_reason: str = ""


# --------------------------------------------------------------------------------------
# git
# --------------------------------------------------------------------------------------

def git(root: Path, *args: str, ok_codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if done.returncode not in ok_codes:
        raise RuntimeError(f"git {' '.join(args[:3])}: {done.stderr.strip()}")
    return done


def check_history(root: Path, revisions: set[str]) -> str:
    """HEAD's hash; NoHistory where this is no git checkout, or a shallow clone lacks a
    record's revision (in a full clone a missing revision is a broken provenance instead)."""
    try:
        top = Path(git(root, "rev-parse", "--show-toplevel").stdout.strip()).resolve()
        head = git(root, "rev-parse", "--verify", "HEAD")
    except (RuntimeError, FileNotFoundError) as exc:
        raise NoHistory(f"not a git checkout (or no git): {exc}; records cannot be checked "
                        "without history", EXIT_NOT_A_CHECKOUT) from None
    if top != root.resolve():  # a copy unpacked inside some other repository
        raise NoHistory(f"{root} is not a git checkout (it lies inside {top})", EXIT_NOT_A_CHECKOUT)
    shallow = git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    missing = sorted(r for r in revisions if not has_commit(root, r))
    if shallow and missing:
        raise NoHistory(f"a shallow clone: {len(missing)} record revision(s) are not here "
                        f"({', '.join(r[:7] for r in missing)}); run `git fetch --unshallow`",
                        EXIT_NO_HISTORY)
    return head.stdout.strip()


def has_commit(root: Path, revision: str) -> bool:
    return git(root, "cat-file", "-e", f"{revision}^{{commit}}", ok_codes=(0, 1, 128)).returncode == 0


def is_ancestor(root: Path, revision: str, head: str) -> bool:
    return git(root, "merge-base", "--is-ancestor", revision, head, ok_codes=(0, 1)).returncode == 0


def changes(root: Path, revision: str, head: str, files: tuple[str, ...]) -> list[Cause]:
    """The commits in revision..head that touched any of `files`, newest first, each with
    the ones among `files` it touched."""
    if not files:
        return []
    out = git(root, "log", "--format=%x1e%H%x1f%s", "--name-only", f"{revision}..{head}",
              "--", *files).stdout
    causes = []
    for record in filter(None, out.split("\x1e")):
        header, _, names = record.partition("\n")
        commit, _, subject = header.partition("\x1f")
        touched = tuple(n for n in names.splitlines() if n.strip())
        if touched:  # a merge lists no files of its own: its parents' commits are listed
            causes.append(Cause(commit, subject, touched))
    return causes


def show(root: Path, revision: str, path: str) -> str | None:
    done = git(root, "show", f"{revision}:{path}", ok_codes=(0, 128))
    return done.stdout if done.returncode == 0 else None


# --------------------------------------------------------------------------------------
# The chapter's source: its code cells
# --------------------------------------------------------------------------------------

@lru_cache(maxsize=512)
def code_cells(text: str) -> tuple[str, ...]:
    """The code cells of a MyST source that shape its outputs: all but the generated
    install cell and the parameters cell (`labkit book sync` rewrites both; the record's
    profile is in the record)."""
    import jupytext

    notebook = jupytext.reads(text, fmt="md:myst")
    return tuple(cell.source.strip() for cell in notebook.cells if cell.cell_type == "code"
                 and not is_install_cell(cell.source) and cell.source != PARAMETERS_SOURCE
                 and "parameters" not in cell.get("metadata", {}).get("tags", []))


def code_changes(root: Path, revision: str, head: str, source: str) -> list[Cause]:
    """Commits in revision..head that changed the code cells of `source` ([] when the code
    cells at head equal those at revision, whatever happened in between)."""
    then, now = show(root, revision, source), show(root, head, source)
    if now is None:
        return []  # not committed yet: nothing to compare
    if then is None:
        return [Cause("", f"it did not exist at the record's revision {revision[:7]}", (source,))]
    if code_cells(then) == code_cells(now):
        return []
    causes = []
    for cause in changes(root, revision, head, (source,)):
        before = show(root, f"{cause.commit}^", source)
        if before is None or code_cells(before) != code_cells(show(root, cause.commit, source) or ""):
            causes.append(Cause(cause.commit, cause.subject, (source,)))
    return causes or [Cause("", "its code cells differ from the record's revision", (source,))]


# --------------------------------------------------------------------------------------
# The allow-list
# --------------------------------------------------------------------------------------

def _strings(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{where}: a list of non-empty strings")
    return tuple(v.strip() for v in value)


def read_allow_list(path: Path, chapters: set[int]) -> AllowList:
    """Parse and check the allow-list; ValueError naming the first problem."""
    if not path.is_file():
        return AllowList()
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    if set(data) - {"allow", "pending_rerun"}:
        raise ValueError(f"unknown sections {sorted(set(data) - {'allow', 'pending_rerun'})}")
    entries = []
    for index, raw in enumerate(data.get("allow", []), start=1):
        where = f"[[allow]] entry {index}"
        if not isinstance(raw, dict) or set(raw) - _ALLOW_KEYS:
            raise ValueError(f"{where}: keys are {sorted(_ALLOW_KEYS)}")
        if raw.get("chapter") not in chapters:
            raise ValueError(f"{where}: chapter {raw.get('chapter')!r} is not a chapter number here")
        commits, files = _strings(raw.get("commits", []), where), _strings(raw.get("files", []), where)
        if not commits and not files:
            raise ValueError(f"{where}: name the commits or the files it excuses")
        if any(len(c) < 7 or not all(ch in "0123456789abcdef" for ch in c) for c in commits):
            raise ValueError(f"{where}: commits are hashes of at least 7 hex digits")
        if not isinstance(raw.get("reason"), str) or len(raw["reason"].strip()) < 10:
            raise ValueError(f"{where}: a reason (a sentence) is required")
        entries.append(AllowEntry(raw["chapter"], commits, files, raw["reason"].strip()))
    pending = data.get("pending_rerun")
    if pending is None:
        return AllowList(tuple(entries))
    if not isinstance(pending, dict) or set(pending) != _PENDING_KEYS:
        raise ValueError(f"[pending_rerun]: exactly the keys {sorted(_PENDING_KEYS)}")
    numbers = pending["chapters"]
    if not isinstance(numbers, list) or any(n not in chapters for n in numbers) \
            or len(set(numbers)) < len(numbers):
        raise ValueError("[pending_rerun]: chapters is a list of distinct chapter numbers here")
    if not isinstance(pending["issue"], int) or not isinstance(pending["reason"], str) \
            or not pending["reason"].strip():
        raise ValueError("[pending_rerun]: issue is a number and reason a sentence")
    return AllowList(tuple(entries), tuple(numbers), pending["issue"], pending["reason"].strip())


# --------------------------------------------------------------------------------------
# Judging every chapter
# --------------------------------------------------------------------------------------

def record_revision(root: Path, number: int) -> str | None:
    path = root / RECORD.format(number=number)
    if not path.is_file():
        return None
    revision = json.loads(path.read_text(encoding="utf-8")).get("git_revision")
    return revision if isinstance(revision, str) and revision.strip() else None


def chapter_sources(root: Path) -> dict[int, str]:
    from labkit.book.runner import chapter_files, chapter_number

    return {chapter_number(p): p.relative_to(root).as_posix() for p in chapter_files(root, ".md")}


def judge(root: Path, repository: Repository, number: int, source: str, head: str,
          allow: AllowList) -> ChapterState:
    state = ChapterState(number, source, record_revision(root, number), pending=number in allow.pending)
    if state.revision is None:
        return state
    if not has_commit(root, state.revision) or not is_ancestor(root, state.revision, head):
        state.causes.append(Cause("", f"the record's revision {state.revision[:7]} is not an "
                                      "ancestor of HEAD: its provenance is broken", ()))
        return state
    causes = code_changes(root, state.revision, head, source)
    try:
        causes += changes(root, state.revision, head, chapter_inputs(root, repository, source).files)
    except SyntaxError as exc:  # its imports cannot be read, so it cannot be judged fresh
        causes.append(Cause("", f"its code cells do not parse as Python (line {exc.lineno}: {exc.msg}); "
                                "its imports are unknown", (source,)))
    entries = [e for e in allow.entries if e.chapter == number]
    for cause in causes:
        open_files = []
        for file in cause.files:
            entry = next((e for e in entries if e.excuses(cause.commit, file)), None)
            if entry is None:
                open_files.append(file)
            else:
                state.excused.append((Cause(cause.commit, cause.subject, (file,)), entry))
        if open_files:
            state.causes.append(Cause(cause.commit, cause.subject, tuple(open_files)))
    return state


def chapter_inputs(root: Path, repository: Repository, source: str) -> ChapterInputs:
    return repository.chapter_inputs(source, list(code_cells((root / source).read_text(encoding="utf-8"))))


def unused_entries(allow: AllowList, states: list[ChapterState]) -> list[AllowEntry]:
    used = {entry for state in states for _, entry in state.excused}
    return [e for e in allow.entries if e not in used]
