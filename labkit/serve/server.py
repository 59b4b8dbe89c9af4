"""`labkit serve`: build the engine client and the app, and run uvicorn until stopped.

The listening socket is bound here, before uvicorn starts, so `--port 0` gets a free port
and the line printed once the server accepts connections names the real one:

    labkit serve: http://127.0.0.1:8000 (model smollm2-135m, engine worker pid 12345)
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn

from labkit.serve.app import ServeSettings, build_app
from labkit.serve.engine_client import InProcessEngine
from labkit.serve.supervision import Supervision
from labkit.serve.worker import WorkerEngine, WorkerSpec


def read_api_keys(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with # are skipped."""
    keys = [line.strip() for line in Path(path).read_text().splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


def engine_fields(args) -> dict:
    fields = {"kv_cache_tokens": args.kv_cache_tokens, "block_size": args.block_size,
              "prefix_caching": not args.no_prefix_caching, "fast_kernels": not args.reference_kernels,
              "weights": args.weights, "kv_dtype": args.kv_dtype,
              "fit_context_to_pool": True}  # a chat request without max_tokens then gets what fits
    if args.max_model_len:
        fields["max_model_len"] = args.max_model_len
    fields["scheduler"] = {"max_num_seqs": args.max_num_seqs, "max_batched_tokens": args.max_batched_tokens}
    return fields


def make_client(args):
    if args.in_process:
        import torch

        from labkit.engine.llm_engine import EngineConfig, LLMEngine
        from labkit.models import load_model

        if args.threads:
            torch.set_num_threads(args.threads)
        from labkit.engine.scheduler import SchedulerConfig

        fields = engine_fields(args)
        fields["scheduler"] = SchedulerConfig(**fields["scheduler"])
        engine = LLMEngine(load_model(args.model), EngineConfig(**fields))
        if engine.weights_fallback:
            logging.getLogger("labkit.serve").warning("%s; the engine runs f32 weights", engine.weights_fallback)
        return InProcessEngine(engine)
    supervision = Supervision(hang_timeout=args.hang_timeout, first_backoff=args.restart_backoff,
                              max_backoff=max(args.restart_backoff, args.max_restart_backoff),
                              max_failed_starts=args.max_failed_starts)
    spec = WorkerSpec(args.model, args.threads, engine_fields(args), fault_file=args.fault_file)
    return WorkerEngine(spec, supervision=supervision)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol named: asyncio disables Nagle's algorithm on accepted connections only when
    # their proto says TCP, and with proto 0 small replies on a kept-alive connection waited
    # for the client's delayed ACK (about 40 ms on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains before stopping: the app refuses new
    requests (503, `Retry-After`) and `/health` says draining while the running requests get
    `--drain-timeout` seconds (`labkit.serve.app`'s `drain`); then the server stops as uvicorn
    does and the process exits 0. SIGINT, or a second SIGTERM, stops at once."""

    def __init__(self, config: uvicorn.Config, drain=None):
        super().__init__(config)
        self.drain, self.loop, self.draining = drain, None, None

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and self.drain is not None and self.draining is None and self.loop is not None:
            # not recorded as captured: uvicorn would raise it again at exit, and we exit 0
            self.draining = True
            self.loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self.draining = self.loop.create_task(self._drain_then_stop(), name="labkit-drain")

    async def _drain_then_stop(self) -> None:
        try:
            await self.drain()
        finally:
            self.should_exit = True


async def _announce(server: uvicorn.Server, url: str, model: str, client) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    pid = getattr(client, "worker_pid", None)
    where = ("the naive transformers foil" if client is None else
             f"engine worker pid {pid}" if pid else "engine in process")
    weights = f", {client.weights} weights" if client is not None else ""
    context = ""
    if client is not None and client.limits is not None:
        context = f", context {client.limits.max_model_len} tokens"
        if client.context_note:
            context += f": {client.context_note}"
    print(f"labkit serve: {url} (model {model}{weights}, {where}{context})", flush=True)


def front_end_tokenizer(args):
    """The model's tokenizer, with the chat template `--chat-template` names in place of the
    file's own (ValueError, with a message for the operator, for one that is not there or does
    not compile)."""
    from labkit.models.loader import load_tokenizer
    from labkit.protocols.templates import chat_template_from

    tokenizer = load_tokenizer(args.model)
    if args.chat_template:
        tokenizer = tokenizer.with_chat_template(chat_template_from(args.chat_template))
    return tokenizer


def serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    try:
        tokenizer = front_end_tokenizer(args)
    except ValueError as e:
        print(f"labkit serve: {e}", file=sys.stderr, flush=True)
        return 2

    if args.naive:
        from labkit.models.reference import load_reference
        from labkit.serve.naive import build_naive_app

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        client = None
        app = build_naive_app(args.model, load_reference(args.model), tokenizer)
    else:
        settings = ServeSettings(model_name=args.model, max_body_bytes=args.max_body_bytes,
                                 api_keys=read_api_keys(args.api_key_file) if args.api_key_file else [],
                                 max_buffered_events=args.max_buffered_events, slow_reader=args.slow_reader,
                                 queue_policy=args.queue_policy, max_queue=args.max_queue,
                                 default_deadline_ms=args.default_deadline_ms,
                                 engine_concurrency=args.max_num_seqs, drain_timeout=args.drain_timeout,
                                 request_timeout=args.request_timeout or None,
                                 max_concurrent_per_key=args.max_concurrent_per_key,
                                 log_prompts=args.log_prompts, sse_keepalive_seconds=args.sse_keepalive or None)
        client = make_client(args)
        app = build_app(client, tokenizer, settings)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    server = DrainingServer(uvicorn.Config(app, log_level=args.log_level, lifespan="on",
                                           timeout_graceful_shutdown=5),
                            drain=getattr(app.state, "drain", None))

    async def main() -> None:
        server.loop = asyncio.get_running_loop()
        announce = asyncio.create_task(_announce(server, url, args.model, client))
        await server.serve(sockets=[sock])
        announce.cancel()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0 if server.started else 1


class BackgroundServer:
    """An app served by uvicorn on a thread of this process (notebooks, tests):

        with BackgroundServer(build_app(InProcessEngine(engine), tokenizer, settings)) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 120.0):
        self.app, self.start_timeout = app, start_timeout
        self.sock = bind(host, port)
        bound_host, bound_port = self.sock.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       name="labkit-serve", daemon=True)

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = threading.Event()
        for _ in range(int(self.start_timeout / 0.05)):
            if self.server.started or not self.thread.is_alive():
                break
            deadline.wait(0.05)
        if not self.server.started:
            self.close()
            raise RuntimeError("the server did not start")
        return self

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __exit__(self, *exc) -> None:
        self.close()


class ServerProcess:
    """`labkit serve --port 0 ARGS` in a child process: start it, wait for the line naming
    its URL, stop it (SIGINT, then SIGKILL) on exit. What benchmarks and tests drive."""

    def __init__(self, *args: str, start_timeout: float = 240.0, host: str = "127.0.0.1"):
        self.command = [sys.executable, "-m", "labkit.cli", "serve", "--host", host, "--port", "0", *args]
        self.start_timeout = start_timeout
        self.lines: list[str] = []
        self.url: str | None = None

    def __enter__(self) -> "ServerProcess":
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def add_arguments(parser) -> None:
    from labkit.engine.backends import KV_DTYPES, PREFERRED_WEIGHTS, WEIGHTS
    from labkit.engine.llm_engine import EngineConfig
    from labkit.engine.scheduler import SchedulerConfig
    from labkit.serve.admission import QUEUE_POLICIES
    from labkit.serve.engine_client import SLOW_READER_POLICIES

    defaults, scheduling = EngineConfig(), SchedulerConfig()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (the printed URL names it)")
    parser.add_argument("--chat-template", metavar="NAME_OR_FILE",
                        help="chat template for the chat, Messages and Responses routes in place of the "
                             "model file's own: a published one (gemma3) or a Jinja file")
    parser.add_argument("--api-key-file", help="one key per line; without it, no authentication")
    parser.add_argument("--threads", type=int, help="torch threads in the engine")
    parser.add_argument("--kv-cache-tokens", type=int, default=defaults.kv_cache_tokens)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--max-model-len", type=int, help="prompt + output limit (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=scheduling.max_num_seqs, help="sequences per step")
    parser.add_argument("--max-batched-tokens", type=int, default=scheduling.max_batched_tokens,
                        help="tokens per step (prefill chunks + decodes)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--reference-kernels", action="store_true", help="F.linear and SDPA, not the C kernels")
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help=f"default: {PREFERRED_WEIGHTS} (the model file's own blocks with float32 "
                             "activations, the fastest mode that keeps float32's greedy tokens on the "
                             "test prompts), or f32 where that cannot run here (with a warning); f32; "
                             "bf16 (matrices and their inputs in bfloat16); gguf-int8 (activations "
                             "rounded to 8 bits, as llama.cpp does)")
    parser.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default=defaults.kv_dtype,
                        help="the KV cache's dtype (default: the model's)")
    parser.add_argument("--in-process", action="store_true", help="run the engine in the server's process")
    parser.add_argument("--naive", action="store_true",
                        help="serve the deliberately naive foil: transformers generate with framework defaults")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-buffered-events", type=int, default=1024,
                        help="events a stream may hold for a slow reader before --slow-reader applies")
    parser.add_argument("--slow-reader", choices=SLOW_READER_POLICIES, default="abort")
    parser.add_argument("--queue-policy", choices=QUEUE_POLICIES, default="bounded",
                        help="admission control (labkit/serve/README.md); bounded: 503 when --max-queue wait")
    parser.add_argument("--max-queue", type=int, default=None,
                        help="waiting requests for bounded and drop-expired (default: --max-num-seqs)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may take from arrival to its end (0: no limit)")
    parser.add_argument("--sse-keepalive", type=float, default=15.0,
                        help="seconds of silence after which a stream gets an SSE comment (0: never)")
    parser.add_argument("--max-concurrent-per-key", type=int, default=None,
                        help="open requests per API key (needs --api-key-file); over it: 429")
    parser.add_argument("--default-deadline-ms", type=float,
                        help="deadline of a request that gives none (default: none)")
    supervision = Supervision()
    parser.add_argument("--hang-timeout", type=float, default=supervision.hang_timeout,
                        help="seconds a worker with work may send nothing before it is killed and replaced")
    parser.add_argument("--restart-backoff", type=float, default=supervision.first_backoff,
                        help="seconds before restarting after a failed worker generation (doubles each time)")
    parser.add_argument("--max-restart-backoff", type=float, default=supervision.max_backoff,
                        help="cap of the doubling wait between worker starts")
    parser.add_argument("--max-failed-starts", type=int, default=supervision.max_failed_starts,
                        help="failed worker generations in a row before the server reports itself failed")
    parser.add_argument("--drain-timeout", type=float, default=25.0,
                        help="seconds running requests get after SIGTERM before they are ended (keep it below "
                             "your orchestrator's grace period: Kubernetes' default is 30 s)")
    parser.add_argument("--fault-file", help="tests and chapters: inject worker faults through this file "
                                             "(labkit/serve/fault_injection.py)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--log-prompts", action="store_true",
                        help="put prompt and output text in the access log (labkit.serve.access, INFO); "
                             "off by default: they may hold what users would not want logged")


if __name__ == "__main__":
    sys.exit("run `labkit serve`")
