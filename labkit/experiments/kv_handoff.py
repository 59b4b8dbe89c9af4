"""Hand a real KV cache from a prefill process to a decode process, and get the same tokens.

    parent ── spawns ──> A (prefill worker)                 B (decode worker)
                         load model, prefill the prompt      load model, say "ready"
                         first token = argmax                 <───────── ready
                         pack K, V, first token, position
                         send the bytes over a Pipe  ──────>  unpack into its own KVCache
                                                              greedy decode from there
    parent <── reports (timings, hashes, tokens) ── A, B

Both workers are separate processes started with the `spawn` method, each loading the
model itself, as two machines would. The cache crosses the channel as plain bytes
(`pack_cache`): a torch tensor sent through a `multiprocessing` Pipe would otherwise
travel as a shared-memory handle, which no network can carry. The parent checks B's
tokens against a single-process greedy run (`labkit.engine.loop.greedy_decode`), and the
SHA-256 of the cache bytes A sent, B received and the parent computes itself.

Times are read from CLOCK_MONOTONIC, which Linux shares across processes, so "A started
sending" and "B had every byte" can be subtracted. The payload is sent `repeats` times, B
acknowledging each before the next, so the transfers do not overlap.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import queue
import struct
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

HEADER = struct.Struct("<I")  # length of the JSON header that precedes the tensor bytes


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for every process


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def cache_bytes(cache, position: int) -> bytes:
    """Keys then values of the first `position` positions of batch row 0, as raw bytes."""
    return _raw(cache.keys[:, :1, :, :position]) + _raw(cache.values[:, :1, :, :position])


def pack_cache(cache, first_token: int) -> bytes:
    """A self-describing payload: header length, a JSON header (shape, dtype, the first
    sampled token, the position where decoding continues), then the cache's bytes."""
    position = cache.length
    shape = list(cache.keys[:, :1, :, :position].shape)
    header = json.dumps({"shape": shape, "dtype": str(cache.keys.dtype).removeprefix("torch."),
                         "first_token": int(first_token), "position": position}).encode()
    return HEADER.pack(len(header)) + header + cache_bytes(cache, position)


def unpack_cache(payload: bytes, model, max_len: int):
    """(a new KVCache of `max_len` positions holding the payload's keys and values,
    the first token, the position) for `model` (its `new_cache` decides dtype and device)."""
    (size,) = HEADER.unpack_from(payload)
    header = json.loads(payload[HEADER.size:HEADER.size + size])
    dtype = getattr(torch, header["dtype"])
    shape, position = header["shape"], header["position"]
    body = torch.frombuffer(bytearray(payload[HEADER.size + size:]), dtype=torch.uint8)
    half = body.numel() // 2
    keys, values = (body[i * half:(i + 1) * half].view(dtype).reshape(shape) for i in (0, 1))
    cache = model.new_cache(1, max_len)
    if cache.keys.dtype != dtype:
        raise ValueError(f"payload holds {dtype}, the model's cache {cache.keys.dtype}")
    cache.keys[:, :, :, :position] = keys
    cache.values[:, :, :, :position] = values
    cache.length = position
    return cache, header["first_token"], position


@torch.no_grad()
def continue_greedy(model, cache, first_token: int, new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens, the first of them `first_token` (chosen by the prefill
    worker), each later one the argmax after feeding the one before through the cache."""
    from labkit.engine.loop import decode_step

    tokens = [int(first_token)]
    next_ids = torch.tensor([[int(first_token)]], device=cache.keys.device)
    while len(tokens) < new_tokens:
        next_ids = decode_step(model, next_ids, cache).argmax(-1, keepdim=True)
        tokens.append(int(next_ids[0, 0]))
    return tokens


# -- the two workers (module level, so a spawned process can import them) --------------------
def prefill_worker(conn, reports, model_name: str, prompt_ids: list[int], new_tokens: int,
                   threads: int, repeats: int) -> None:
    """Process A: prefill, pick the first token, wait for B, send the cache `repeats` times."""
    from labkit.models import load_model

    torch.set_num_threads(threads)
    model = load_model(model_name)
    cache = model.new_cache(1, len(prompt_ids) + new_tokens)
    start = _now()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids]), cache=cache, last_only=True)[:, -1]
    first = int(logits.argmax(-1)[0])
    prefill_s = _now() - start
    start = _now()
    payload = pack_cache(cache, first)
    pack_s = _now() - start
    if conn.recv() != "ready":
        raise RuntimeError("the decode worker did not say it was ready")
    sent_at = []
    for _ in range(repeats):
        sent_at.append(_now())
        conn.send_bytes(payload)
        conn.recv()  # B's acknowledgement: it has every byte
    reports.put(("A", {"prefill_s": prefill_s, "pack_s": pack_s, "sent_at": sent_at,
                       "payload_bytes": len(payload), "first_token": first,
                       "sha256": hashlib.sha256(cache_bytes(cache, cache.length)).hexdigest()}))
    conn.close()


def decode_worker(conn, reports, model_name: str, new_tokens: int, threads: int,
                  repeats: int) -> None:
    """Process B: load the model, say ready, receive the cache, decode from it."""
    from labkit.models import load_model

    torch.set_num_threads(threads)
    model = load_model(model_name)
    conn.send("ready")
    received_at, payload = [], b""
    for _ in range(repeats):
        payload = conn.recv_bytes()
        received_at.append(_now())
        conn.send("ack")
    start = _now()
    header = json.loads(payload[HEADER.size:HEADER.size + HEADER.unpack_from(payload)[0]])
    cache, first, position = unpack_cache(payload, model, header["position"] + new_tokens)
    unpack_s = _now() - start
    start = _now()
    tokens = continue_greedy(model, cache, first, new_tokens)
    reports.put(("B", {"received_at": received_at, "unpack_s": unpack_s,
                       "decode_s": _now() - start, "tokens": tokens, "position": position,
                       "sha256": hashlib.sha256(cache_bytes(cache, position)).hexdigest()}))
    conn.close()


@dataclass
class HandoffResult:
    prompt_tokens: int
    tokens: list[int]                 # B's tokens (the first one chosen by A)
    reference: list[int]              # one process, prefill and decode in the same cache
    payload_bytes: int                # what crossed the Pipe, header included
    kv_bytes: int                     # of that, the keys and values
    closed_form_bytes_per_token: int  # layers x 2 x kv_heads x head_dim x dtype bytes
    transfer_s: list[float]           # A starts sending -> B holds every byte, per repeat
    hashes: dict[str, str] = field(default_factory=dict)  # cache SHA-256: A, B, reference
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.tokens == self.reference

    @property
    def first_difference(self) -> int | None:
        return next((i for i, (a, b) in enumerate(zip(self.tokens, self.reference)) if a != b), None)

    @property
    def cache_identical(self) -> bool:
        return len(set(self.hashes.values())) == 1

    @property
    def bytes_per_token(self) -> float:
        return self.kv_bytes / self.prompt_tokens


def run_handoff(model, model_name: str, prompt_ids: Sequence[int], new_tokens: int, *,
                repeats: int = 5, threads: int | None = None, timeout_s: float = 300.0) -> HandoffResult:
    """Run A and B as two spawned processes on `prompt_ids` and compare B's `new_tokens`
    tokens with a single-process greedy run of `model` (the parent's copy of `model_name`),
    all at `threads` threads (default: the parent's), since a different thread count can
    sum a matrix product in a different order."""
    from labkit.engine.loop import greedy_decode
    from labkit.sim.disaggregation import kv_bytes_per_token

    threads = threads or torch.get_num_threads()
    prompt_ids = [int(t) for t in prompt_ids]
    ctx = mp.get_context("spawn")
    a_end, b_end = ctx.Pipe(duplex=True)
    reports = ctx.Queue()
    workers = [ctx.Process(target=prefill_worker, name="prefill-worker",
                           args=(a_end, reports, model_name, prompt_ids, new_tokens, threads, repeats)),
               ctx.Process(target=decode_worker, name="decode-worker",
                           args=(b_end, reports, model_name, new_tokens, threads, repeats))]
    for w in workers:
        w.start()
    got, deadline = {}, _now() + timeout_s
    try:
        while len(got) < 2:
            try:
                name, report = reports.get(timeout=1.0)
                got[name] = report
            except queue.Empty:
                failed = [w.name for w in workers if w.exitcode not in (None, 0)]
                if failed or _now() > deadline:
                    raise RuntimeError(f"handoff did not finish (failed: {failed or 'none'})")
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.terminate()
    a, b = got["A"], got["B"]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reference = greedy_decode(model, prompt_ids, new_tokens).token_ids
        cache = model.new_cache(1, len(prompt_ids) + new_tokens)
        with torch.no_grad():
            model(torch.tensor([prompt_ids]), cache=cache, last_only=True)
    finally:
        torch.set_num_threads(previous)
    c = model.config
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim,
                                   cache.keys.element_size())
    kv = len(cache_bytes(cache, len(prompt_ids)))
    return HandoffResult(
        len(prompt_ids), b["tokens"], reference, a["payload_bytes"], kv, per_token,
        [r - s for s, r in zip(a["sent_at"], b["received_at"])],
        {"prefill worker sent": a["sha256"], "decode worker received": b["sha256"],
         "single process": hashlib.sha256(cache_bytes(cache, len(prompt_ids))).hexdigest()},
        {"prefill_s": a["prefill_s"], "pack_s": a["pack_s"], "unpack_s": b["unpack_s"],
         "decode_s": b["decode_s"]})
