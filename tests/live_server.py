"""`labkit serve` as the tests run it: a real process on a free loopback port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent / "labkit"


class LiveServer:
    """Start `labkit serve --port 0 ARGS`, wait for the line that names its URL, stop it on exit."""

    def __init__(self, *args: str, start_timeout: float = 240.0):
        self.args, self.start_timeout = list(args), start_timeout
        self.lines: list[str] = []

    def __enter__(self) -> "LiveServer":
        command = [str(BIN), "serve", "--host", "127.0.0.1", "--port", "0", *self.args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=os.environ | {"PYTHONUNBUFFERED": "1"})
        found = threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                self.lines.append(line)
                match = re.search(r"labkit serve: (http://\S+)", line)
                if match:
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not found.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("labkit serve did not start:\n" + "".join(self.lines[-40:]))
        return self

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, timeout=60, **kwargs)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_until(self, condition, timeout: float = 10.0, interval: float = 0.05) -> float:
        """Seconds until `condition()` held; AssertionError after `timeout`."""
        start = time.monotonic()
        while not condition():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"condition not met within {timeout} s")
            time.sleep(interval)
        return time.monotonic() - start

    def idle(self) -> bool:
        return (self.metric("labkit_running_sequences") == 0 and self.metric("labkit_queue_length") == 0
                and self.metric("labkit_kv_blocks_used") == 0)

    def ready(self) -> bool:
        try:
            return self.get("/health").status_code == 200
        except httpx.HTTPError:
            return False
