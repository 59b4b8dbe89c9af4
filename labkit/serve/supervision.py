"""How the front end watches its engine worker: when a worker is dead or hung, how long to
wait before the next start, and when to stop trying.

    alive and advancing ---------------------------------------------> ready
    exited, or has work and sent nothing for `hang_timeout` seconds --> killed, restarted
    `max_failed_starts` failed generations in a row ----------------> failed (no more starts)

A worker *advances* when it sends a batch: it does so after every engine step that produced
an event or changed its counters, so a worker with work that is silent for `hang_timeout`
seconds is stuck (in a kernel, a deadlock, or `SIGSTOP`). A step's length is bounded by the
scheduler's token budget (`--max-batched-tokens`, chunked prefill), so the default of 60 s
(vLLM's `VLLM_ENGINE_ITERATION_TIMEOUT_S`) is far above any healthy step here.

A *generation* (one worker process) has *served* once it has sent an event for a request (a
token, or a request's end). It has failed if it did not start, or if it died or hung before it
served and within `stable_after` seconds of its start: a worker that crashes in its first step
with work (a kernel fault, a first-step allocation) fails like one that cannot build its engine,
while an idle worker killed after a long quiet run is replaced at once. A generation that served
resets the count. Between failed generations the wait doubles from `first_backoff` up to
`max_backoff`, so a worker that dies at start-up costs a few starts a minute, not ten a second.
"""

from __future__ import annotations

from dataclasses import dataclass

STATES = ("starting", "ready", "restarting", "failed", "stopped")


@dataclass(frozen=True)
class Supervision:
    poll_interval: float = 0.1      # s between looks at the worker
    hang_timeout: float = 60.0      # s without a batch, while it has work, before it counts as hung
    first_backoff: float = 0.5      # s before the start that follows one failed generation
    max_backoff: float = 30.0       # s, the cap of the doubling
    max_failed_starts: int = 5      # failed generations in a row before the server gives up
    stable_after: float = 60.0      # s: a generation that lived this long without serving did not fail

    def __post_init__(self) -> None:
        for name in ("poll_interval", "hang_timeout", "first_backoff", "max_backoff", "stable_after"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_backoff < self.first_backoff:
            raise ValueError("max_backoff must be at least first_backoff")
        if self.max_failed_starts < 1:
            raise ValueError("max_failed_starts must be at least 1")

    def backoff(self, failures: int) -> float:
        """Seconds to wait before the next start after `failures` failed generations in a row
        (0 after none: a worker that served and then died is replaced at once)."""
        if failures <= 0:
            return 0.0
        return min(self.max_backoff, self.first_backoff * 2.0 ** (failures - 1))

    def generation_failed(self, served: bool, lived_for: float) -> bool:
        """True when a worker that died or hung after `lived_for` seconds counts as a failed
        generation: it never served a request and did not live `stable_after` seconds."""
        return not served and lived_for < self.stable_after

    def gives_up(self, failures: int) -> bool:
        return failures >= self.max_failed_starts

    def hung(self, has_work: bool, silent_for: float) -> bool:
        """True when a worker that has work has sent nothing for longer than `hang_timeout`."""
        return has_work and silent_for > self.hang_timeout
