"""Load against an OpenAI-compatible URL over real sockets, one record per request.

    closed loop: `concurrency` clients, each sends its next request when the last one ends
    open loop:   each request is sent at its arrival time, whatever is still running

Requests stream (`stream: true` with `include_usage`) unless `extra` says `"stream": False`,
so the client sees each token as it arrives: the record keeps the send time, the arrival of
every chunk with text, the end, the usage the server reported and any error. A whole answer
keeps its `Server-Timing` stages instead. `summarize` gives the percentiles serving
benchmarks report: TTFT (send to first token), TPOT (the rest of the request per further
token), ITL (every gap between tokens) and E2E (send to the end).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

from labkit.util.timing import quantile


@dataclass
class HttpRecord:
    request: int
    prompt_tokens: int
    sent_s: float                        # from the start of the run
    token_s: list[float] = field(default_factory=list, repr=False)  # arrival of each text chunk
    end_s: float | None = None
    output_tokens: int = 0               # from the server's usage
    text: str = ""
    status: int | None = None
    error: str | None = None
    server_timing: dict[str, float] = field(default_factory=dict)  # ms, whole answers only

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.sent_s if self.token_s else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if not self.token_s or self.output_tokens < 2 or self.end_s is None:
            return None
        return (self.end_s - self.token_s[0]) / (self.output_tokens - 1)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """`read;dur=0.1, parse;dur=0.2` -> {"read": 0.1, "parse": 0.2} (milliseconds)."""
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        if name and rest.startswith("dur="):
            out[name] = float(rest[4:])
    return out


async def _whole(client: httpx.AsyncClient, url: str, body: dict, record: HttpRecord, start: float,
                 headers: dict) -> None:
    record.sent_s = time.perf_counter() - start
    try:
        answer = await client.post(url, json=body | {"stream": False}, headers=headers)
        record.status = answer.status_code
        if answer.status_code != 200:
            record.error = answer.text[:500]
            return
        payload = answer.json()
        record.output_tokens = payload["usage"]["completion_tokens"]
        record.text = "".join(c.get("text") or (c.get("message") or {}).get("content") or ""
                              for c in payload["choices"])
        record.server_timing = parse_server_timing(answer.headers.get("server-timing"))
    except httpx.HTTPError as error:
        record.error = repr(error)
    finally:
        record.end_s = time.perf_counter() - start


async def _one(client: httpx.AsyncClient, url: str, body: dict, record: HttpRecord, start: float,
               headers: dict) -> None:
    if not body.get("stream"):
        return await _whole(client, url, body, record, start, headers)
    record.sent_s = time.perf_counter() - start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as answer:
            record.status = answer.status_code
            if answer.status_code != 200:
                record.error = (await answer.aread()).decode(errors="replace")[:500]
                return
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    record.error = json.dumps(payload["error"])
                    continue
                if payload.get("usage"):
                    record.output_tokens = payload["usage"]["completion_tokens"]
                for choice in payload.get("choices", []):
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        record.token_s.append(time.perf_counter() - start)
                        record.text += piece
    except httpx.HTTPError as error:
        record.error = repr(error)
    finally:
        record.end_s = time.perf_counter() - start


def _body(model: str, prompt: list[int], max_tokens: int, extra: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if not body["stream"]:
        body.pop("stream_options")
    return body


async def _closed(url, model, prompts, max_tokens, concurrency, extra, headers,
                  stagger: float) -> tuple[list[HttpRecord], float]:
    records = [HttpRecord(i, len(p), 0.0) for i, p in enumerate(prompts)]
    queue = list(range(len(prompts)))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def worker(index: int):
            await asyncio.sleep(index * stagger)
            while queue:
                i = queue.pop(0)
                await _one(client, url, _body(model, prompts[i], max_tokens[i], extra), records[i], start, headers)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return records, time.perf_counter() - start


async def _open(url, model, prompts, max_tokens, arrivals, extra, headers,
                give_up_s: float | None) -> tuple[list[HttpRecord], float]:
    records = [HttpRecord(i, len(p), 0.0) for i, p in enumerate(prompts)]
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def at(i):
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
            await _one(client, url, _body(model, prompts[i], max_tokens[i], extra), records[i], start, headers)

        try:
            await asyncio.wait_for(asyncio.gather(*(at(i) for i in range(len(prompts)))), give_up_s)
        except asyncio.TimeoutError:
            pass  # the open requests were cancelled: their connections closed, status None
        return records, time.perf_counter() - start


def run_closed_loop(base_url: str, model: str, prompts: list[list[int]], max_tokens: list[int], concurrency: int,
                    *, extra: dict | None = None, api_key: str | None = None,
                    stagger: float = 0.0) -> tuple[list[HttpRecord], float]:
    """Records and wall seconds of a closed-loop run against `base_url` (e.g. http://host:port).
    Client i sends its first request `i * stagger` seconds after the start: with a few
    milliseconds each request reaches the server before the next is sent, so the server sees
    them in the order of their send times (which a replay in process can then follow)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return asyncio.run(_closed(base_url + "/v1/completions", model, prompts, max_tokens, concurrency,
                               extra or {}, headers, stagger))


def run_open_loop(base_url: str, model: str, prompts: list[list[int]], max_tokens: list[int],
                  arrivals: list[float], *, extra: dict | None = None,
                  api_key: str | None = None,
                  give_up_s: float | None = None) -> tuple[list[HttpRecord], float]:
    """Records and wall seconds of an open-loop run. With `give_up_s`, the client stops
    waiting that many seconds after the start and closes every open connection (the server
    sees disconnects); a request still open then keeps `status` None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return asyncio.run(_open(base_url + "/v1/completions", model, prompts, max_tokens, arrivals,
                             extra or {}, headers, give_up_s))


def percentiles(values: list[float], qs=(0.5, 0.9, 0.99)) -> dict:
    if not values:
        return {f"p{round(q * 100)}": None for q in qs} | {"mean": None}
    return {f"p{round(q * 100)}": quantile(values, q) for q in qs} | {"mean": statistics.fmean(values)}


def summarize(records: list[HttpRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.ok]
    gaps = [b - a for r in ok for a, b in zip(r.token_s, r.token_s[1:])]
    output = sum(r.output_tokens for r in ok)
    return {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok), "wall_s": wall_s,
            "output_tokens": output, "output_tokens_per_s": output / wall_s if wall_s else None,
            "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl_s": percentiles(gaps), "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None])}


def records_dict(records: list[HttpRecord]) -> list[dict]:
    return [asdict(r) | {"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s} for r in records]
