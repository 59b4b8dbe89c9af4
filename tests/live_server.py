"""`labkit serve` as the tests run it: a real process on a free loopback port, with the
questions the tests ask of it (a metric, whether it is idle or ready)."""

from __future__ import annotations

import time

import httpx

from labkit.serve.server import ServerProcess


class LiveServer(ServerProcess):
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
