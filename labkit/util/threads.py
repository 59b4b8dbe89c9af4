"""Run a call on a thread of its own and hand back its result or its exception.

`asyncio.run` cannot start where an event loop already runs (a notebook's kernel); on a
fresh thread it always can, so helpers that drive asyncio clients go through this."""

from __future__ import annotations

import threading


def run_in_thread(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a fresh thread, waited for; its exception re-raised here."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            box["error"] = error

    thread = threading.Thread(target=run, name="labkit-run-in-thread")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
