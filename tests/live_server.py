"""`labkit serve` as the tests run it: a real process on a free loopback port, with the
questions the tests ask of it (a metric, whether it is idle or ready)."""

from __future__ import annotations

import time

import httpx

from labkit.experiments.fault_client import parse_metrics
from labkit.serve.server import ServerProcess


class LiveServer(ServerProcess):
    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """{series: value}, series named as `fault_client.parse_metrics` names them (labels
        sorted, less model_name): 'labkit:requests_total{outcome="ok",route="chat"}'."""
        return parse_metrics(self.get("/metrics").text)

    def metric(self, name: str) -> float:
        return self.metrics()[name]

    def wait_until(self, condition, timeout: float = 10.0, interval: float = 0.05) -> float:
        """Seconds until `condition()` held; AssertionError after `timeout`."""
        start = time.monotonic()
        while not condition():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"condition not met within {timeout} s")
            time.sleep(interval)
        return time.monotonic() - start

    def idle(self) -> bool:
        m = self.metrics()  # False while the engine's gauges are absent (a worker restarting)
        return all(m.get(name) == 0 for name in ("labkit:num_requests_running", "labkit:num_requests_waiting",
                                                   "labkit:kv_blocks_used"))

    def ready(self) -> bool:
        try:
            return self.get("/health").status_code == 200
        except httpx.HTTPError:
            return False
