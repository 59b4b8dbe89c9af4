"""What `labkit serve` is configured with, and how an API key becomes a prefix-cache scope."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from labkit.serve.admission import QUEUE_POLICIES
from labkit.serve.engine_client import SLOW_READER_POLICIES


@dataclass
class ServeSettings:
    model_name: str
    max_body_bytes: int = 1 << 20
    api_keys: list[str] = field(default_factory=list)   # empty: no authentication
    max_buffered_events: int = 1024                     # per stream, before the slow-reader policy
    slow_reader: str = "abort"
    retry_after_seconds: float = 1.0
    queue_policy: str = "bounded"                       # backpressure by default (chapter 26)
    max_queue: int | None = None                        # waiting requests; None: engine_concurrency
    default_deadline_ms: float | None = None
    request_timeout: float | None = 600.0               # s from arrival to the end; None: no limit
    max_concurrent_per_key: int | None = None           # open requests per API key; None: no limit
    sse_keepalive_seconds: float | None = 15.0          # a silent stream gets an SSE comment; None: never
    engine_concurrency: int = 64                        # the engine's max_num_seqs
    drain_timeout: float = 25.0                         # s that running requests get after SIGTERM
    log_prompts: bool = False                           # prompt and output text in the access log

    def __post_init__(self) -> None:
        if self.slow_reader not in SLOW_READER_POLICIES:
            raise ValueError(f"slow_reader must be one of {SLOW_READER_POLICIES}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {QUEUE_POLICIES}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("request_timeout must be positive (None: no limit)")
        if self.max_concurrent_per_key is not None:
            if self.max_concurrent_per_key < 1:
                raise ValueError("max_concurrent_per_key must be at least 1")
            if not self.api_keys:
                raise ValueError("a limit per API key needs API keys (--api-key-file)")

    @property
    def queue_limit(self) -> int:
        """Requests that may wait: one full batch of the engine's by default."""
        return self.engine_concurrency if self.max_queue is None else self.max_queue


def tenant_of(api_key: str | None) -> str | None:
    """A tenant's prefix-cache scope, derived from its key (the key itself is never stored)."""
    return None if api_key is None else "tenant-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def cache_scope(tenant: str | None, cache_salt: str | None) -> str | None:
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"
