"""The process side of the distributed-inference study: what each rank runs under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m labkit.experiments.distributed_worker generate --mode tensor --out DIR ...
    ... -m labkit.experiments.distributed_worker bench --sizes 8,2304,262144 --out DIR

`generate` loads this rank's shard (tensor or pipeline parallel, `labkit.models.parallel`),
runs an untimed warm-up generation (the first calls pay one-time costs), then the timed
greedy run, and gathers every rank's record to rank 0, which
writes `run.json`; the last rank writes the logits to `logits.pt`. `bench` times
all-reduce and a ring of sends (rank 0 -> 1 -> ... -> 0, the pipeline's pattern) for each
message size and writes `bench.json`. The launcher is `labkit.experiments.distributed`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.models.loader import ensure_dequantized
from labkit.models.parallel import (DistComm, SafetensorsReader, pipeline_generate, pipeline_stage,
                                    tensor_parallel_generate, tensor_parallel_model, weight_bytes)


def init(threads: int, backend: str) -> tuple[str, torch.device]:
    """Join the torchrun group: "nccl" (one GPU per rank), "gloo" (the CPU), or "auto":
    NCCL where there is a GPU for every rank, gloo otherwise."""
    if backend == "auto":
        world = int(os.environ.get("WORLD_SIZE", 1))
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend)
    torch.set_num_threads(threads)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return backend, device
    return backend, torch.device("cpu")


def generate(args: argparse.Namespace) -> None:
    backend, device = init(args.threads, args.backend)
    comm = DistComm.from_default_group()
    path, config, _ = ensure_dequantized(args.model)
    prompt = json.loads(Path(args.prompt_file).read_text())
    start = time.perf_counter()
    read = SafetensorsReader(path)
    clock = lambda: sum(count.seconds for count in comm.counts.values())  # noqa: E731
    if args.mode == "tensor":
        split = tensor_parallel_model(read, config, comm).to(device)
        run_once = lambda n: tensor_parallel_generate(split, prompt, n, clock)  # noqa: E731
    elif args.mode == "pipeline":
        split = pipeline_stage(read, config, comm).to(device)
        run_once = lambda n: pipeline_generate(split, comm, prompt, n, clock)  # noqa: E731
    else:
        raise SystemExit(f"unknown mode {args.mode!r}")
    del read
    load_seconds = time.perf_counter() - start
    warmup = run_once(min(3, args.new_tokens))  # untimed: the first calls' one-time costs
    for count in comm.counts.values():
        count.calls, count.bytes, count.seconds = 0, 0, 0.0
    dist.barrier()
    run = run_once(args.new_tokens)
    record = {"rank": comm.rank, "tokens": run.tokens, "prefill_s": run.prefill_seconds,
              "step_s": run.step_seconds, "prefill_comm_s": run.prefill_comm_seconds,
              "step_comm_s": run.step_comm_seconds, "comm": comm.summary(), "load_s": load_seconds,
              "warmup_prefill_s": warmup.prefill_seconds,
              "weight_bytes": weight_bytes(split), "threads": torch.get_num_threads()}
    records = [None] * comm.world
    dist.all_gather_object(records, record)
    out = Path(args.out)
    if comm.rank == comm.world - 1:
        torch.save(run.logits.cpu(), out / "logits.pt")
    if comm.rank == 0:
        with_tokens = [r["tokens"] for r in records if r["tokens"]]
        summary = {"mode": args.mode, "procs": comm.world, "backend": backend,
                   "threads_per_rank": args.threads, "prompt_tokens": len(prompt),
                   "new_tokens": args.new_tokens, "tokens": run.tokens,
                   "ranks_agree": all(t == with_tokens[0] for t in with_tokens), "ranks": records}
        (out / "run.json").write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


def bench(args: argparse.Namespace) -> None:
    backend, device = init(1, args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        t = torch.zeros(max(1, nbytes // 4), device=device)
        ops = {"all_reduce": lambda: dist.all_reduce(t)}
        if world > 1:
            ops["ring_hop"] = lambda: ring(t, rank, world)
        for op, call in ops.items():
            for _ in range(args.warmup):
                call()
            seconds = []
            for _ in range(args.repeats):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.inner):
                    call()
                per_call = (time.perf_counter() - start) / args.inner
                seconds.append(per_call / world if op == "ring_hop" else per_call)
            samples.append({"op": op, "bytes": t.nbytes, "seconds": seconds})
    if rank == 0:
        (Path(args.out) / "bench.json").write_text(json.dumps(
            {"procs": world, "backend": backend, "inner": args.inner, "samples": samples}))
    dist.barrier()
    dist.destroy_process_group()


def ring(t: torch.Tensor, rank: int, world: int) -> None:
    """One message once round the ring, rank 0 -> 1 -> ... -> world-1 -> 0."""
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, world - 1)
    else:
        dist.recv(t, rank - 1)
        dist.send(t, (rank + 1) % world)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="distributed_worker")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--mode", choices=("tensor", "pipeline"), required=True)
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompt-file", required=True)
    g.add_argument("--new-tokens", type=int, required=True)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--out", required=True)
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="gloo")
    b = sub.add_parser("bench")
    b.add_argument("--sizes", required=True)
    b.add_argument("--repeats", type=int, default=10)
    b.add_argument("--inner", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--out", required=True)
    b.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    generate(args) if args.command == "generate" else bench(args)


if __name__ == "__main__":
    main()
