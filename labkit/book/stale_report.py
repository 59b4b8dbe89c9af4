"""The `labkit book stale` command: judge the chapters (:mod:`labkit.book.stale`) and say
which records are stale and why, in words a reviewer can act on.

Exit status: 0 every record fresh, excused or pending re-run; 1 a stale record, an
allow-list entry that excuses nothing, a pending chapter that is fresh again, or a bad
allow-list; 3 not a git checkout (a tarball); 4 a shallow clone that lacks a record's
revision.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from labkit.book.chapter_inputs import Repository
from labkit.book.stale import (
    ALLOW_FILE,
    EXIT_OK,
    EXIT_STALE,
    AllowList,
    ChapterState,
    NoHistory,
    chapter_sources,
    check_history,
    judge,
    read_allow_list,
    record_revision,
    unused_entries,
)

SUBJECT_WIDTH = 72
PENDING_SHOWN = 3  # commits shown for a chapter pending re-run (all with --verbose)


def _subject(text: str) -> str:
    return text if len(text) <= SUBJECT_WIDTH else text[:SUBJECT_WIDTH - 3] + "..."


def _cause_lines(state: ChapterState, limit: int | None) -> list[str]:
    shown = state.causes if limit is None else state.causes[:limit]
    lines = []
    for cause in shown:
        lines.append(f"      {cause.short} {_subject(cause.subject)}")
        lines += [f"              {file}{' (code cells)' if file == state.source else ''}"
                  for file in cause.files]
    if len(shown) < len(state.causes):
        lines.append(f"      ... and {len(state.causes) - len(shown)} older commit(s) (--verbose lists them)")
    return lines


def describe(state: ChapterState, verbose: bool) -> list[str]:
    label = f"ch{state.number:02d}"
    if state.revision is None:
        return [f"{label}  NO RECORD  ({state.source} has no results/ch{state.number:02d}/metrics.json "
                "with a git_revision)"]
    record = f"record {state.revision[:7]}"
    excused = f"; {len(state.excused)} change(s) excused by {ALLOW_FILE}" if state.excused else ""
    if not state.stale:
        return [f"{label}  fresh      {record}{excused}"]
    files = len({f for c in state.causes for f in c.files})
    summary = f"{len(state.causes)} commit(s) since changed {files} of its inputs{excused}"
    if state.pending:
        return [f"{label}  STALE, PENDING RE-RUN  {record}: {summary}",
                *_cause_lines(state, None if verbose else PENDING_SHOWN)]
    return [f"{label}  STALE      {record}: {summary}", *_cause_lines(state, None)]


def report(states: list[ChapterState], allow: AllowList, head: str, out: TextIO,
           verbose: bool = False, judged_all: bool = True) -> int:
    """Print every chapter's state and the verdict; return the exit status."""
    print(f"labkit book stale: {len(states)} chapter(s) against HEAD {head[:7]} "
          f"(inputs: code cells, the labkit modules they import, the files those read)", file=out)
    for state in states:
        print("\n".join(describe(state, verbose)), file=out)
    failures = []
    stale = [s for s in states if s.stale and not s.pending]
    if stale:
        failures.append(f"{len(stale)} stale record(s): {' '.join(f'ch{s.number:02d}' for s in stale)}. "
                        "Re-run them (`labkit book run --profile full N`), or excuse a change that "
                        f"cannot touch the outputs in {ALLOW_FILE} with the reason")
    judged = {s.number for s in states}
    considered = allow if judged_all else AllowList(
        tuple(e for e in allow.entries if e.chapter in judged), allow.pending)
    for entry in unused_entries(considered, states):
        failures.append(f"{ALLOW_FILE}: the entry for ch{entry.chapter:02d} "
                        f"({', '.join(entry.commits + entry.files)}) excuses nothing now: remove it")
    back = [s for s in states if s.pending and not s.stale and s.revision is not None]
    if back:
        failures.append(f"{ALLOW_FILE}: pending re-run lists {' '.join(f'ch{s.number:02d}' for s in back)}, "
                        "fresh now: take them off the list")
    pending = [s for s in states if s.pending and s.stale]
    if pending:
        print(f"\n!!! {len(pending)} chapter(s) STALE and PENDING RE-RUN (issue {allow.pending_issue}): "
              f"{' '.join(f'ch{s.number:02d}' for s in pending)}\n!!! {allow.pending_reason}\n"
              f"!!! tolerated only while listed in [pending_rerun] of {ALLOW_FILE}", file=out)
    missing = [s for s in states if s.revision is None]
    if missing:
        print(f"\n{len(missing)} chapter(s) without a record (not judged): "
              f"{' '.join(f'ch{s.number:02d}' for s in missing)}", file=out)
    if failures:
        print("\nFAILED:\n" + "\n".join(f"  - {f}" for f in failures), file=out)
        return EXIT_STALE
    print("\nok: every record is fresh, excused with a reason, or pending re-run", file=out)
    return EXIT_OK


def run_stale(root: str | Path, chapters: list[str] | None = None, verbose: bool = False,
              out: TextIO = sys.stdout) -> int:
    """`labkit book stale [CHAPTER ...]`: the exit status (see the module docstring)."""
    root = Path(root).resolve()
    sources = chapter_sources(root)
    if chapters:
        from labkit.book.runner import chapter_number, resolve_chapters

        try:
            wanted = sorted({chapter_number(p) for p in resolve_chapters(chapters, root)})
        except (ValueError, FileNotFoundError) as exc:
            print(f"labkit book stale: {exc}", file=sys.stderr)
            return 2
    else:
        wanted = sorted(sources)
    try:
        allow = read_allow_list(root / ALLOW_FILE, set(sources))
    except (ValueError, OSError) as exc:
        print(f"labkit book stale: {ALLOW_FILE}: {exc}", file=out)
        return EXIT_STALE
    revisions = {r for n in wanted if (r := record_revision(root, n))}
    try:
        head = check_history(root, revisions)
    except NoHistory as exc:
        print(f"labkit book stale: cannot judge the records: {exc}", file=out)
        return exc.status
    repository = Repository(root)
    states = [judge(root, repository, n, sources[n], head, allow) for n in wanted]
    return report(states, allow, head, out, verbose=verbose, judged_all=not chapters)
