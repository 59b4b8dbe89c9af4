"""run_in_thread: the result or the exception of a call made on another thread."""

import asyncio
import threading

import pytest

from labkit.util.threads import run_in_thread


def test_returns_the_value_from_another_thread():
    assert run_in_thread(lambda a, b=0: (a + b, threading.current_thread().name), 2, b=3) == (
        5, "labkit-run-in-thread")


def test_reraises_the_calls_exception():
    def fail():
        raise KeyError("x")

    with pytest.raises(KeyError):
        run_in_thread(fail)


def test_asyncio_run_works_inside_a_running_loop():
    async def outer():
        return run_in_thread(lambda: asyncio.run(asyncio.sleep(0, result=7)))

    assert asyncio.run(outer()) == 7
