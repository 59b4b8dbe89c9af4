"""Run one batch workload on vLLM's CPU build and print what it measured (a peer for
`labkit bench lowbit`).

This file is run BY the python of the separate vLLM virtual environment (`.venv-vllm`, made
by `make peers`), never imported into it from labkit: vLLM pins its own transformers and
torch, which cannot share labkit's venv. So it imports nothing from labkit and nothing
outside the standard library, vllm and torch; `labkit.bench.peers.VLLMCpu` writes its
request and reads its answer as JSON files.

    python vllm_worker.py REQUEST.json RESULT.json

REQUEST.json holds model_dir (a Hugging Face-format folder), dtype ("float32" or
"bfloat16"), threads, prompts (token-id lists), max_tokens (one per prompt), rounds and
kv_cache_gib (optional: max_num_seqs, max_num_batched_tokens, enforce_eager). RESULT.json
gets the timings of every round, the token ids of every request in the first round, the
versions and the start-up seconds; on failure, an "error" line and the stage it failed in.

The functions above `main` are plain Python, so labkit's tests check them without vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

DTYPES = ("float32", "bfloat16")
REQUIRED = ("model_dir", "dtype", "threads", "prompts", "max_tokens", "rounds", "kv_cache_gib")
WARMUP_TOKENS = 4


def read_request(text: str) -> dict:
    """The request as a dict with its defaults filled in; a ValueError names what is wrong,
    so a bad request fails before vLLM spends a minute starting."""
    request = json.loads(text)
    missing = [key for key in REQUIRED if key not in request]
    if missing:
        raise ValueError(f"request lacks {', '.join(missing)}")
    if request["dtype"] not in DTYPES:
        raise ValueError(f"dtype {request['dtype']!r} is not one of {', '.join(DTYPES)}")
    prompts, max_tokens = request["prompts"], request["max_tokens"]
    if not prompts or len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    if any(not prompt for prompt in prompts) or any(int(m) < 1 for m in max_tokens):
        raise ValueError("every prompt needs a token and every request at least one output token")
    if int(request["threads"]) < 1 or int(request["rounds"]) < 1 or int(request["kv_cache_gib"]) < 1:
        raise ValueError("threads, rounds and kv_cache_gib must be at least 1")
    # eager by default: otherwise vLLM's CPU build traces the model and compiles it with
    # inductor (C++ through the system compiler) at start-up, minutes on two cores
    request = {"enforce_eager": True, "max_num_seqs": None, "max_num_batched_tokens": None, **request}
    # the longest request bounds the context; vLLM refuses a prompt that does not fit
    request["max_model_len"] = max(len(p) + int(m) for p, m in zip(prompts, max_tokens))
    return request


def cpu_binding(threads: int, allowed: set[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads on the lowest allowed CPUs,
    e.g. "0-1" (vLLM's own "auto" keeps one logical CPU per physical core and may hold
    some back, so it would not run the thread count labkit runs)."""
    chosen = sorted(allowed)[:threads]
    if len(chosen) < threads:
        raise ValueError(f"{threads} threads asked for but only CPUs {sorted(allowed)} are allowed")
    ranges = [[chosen[0], chosen[0]]]  # consecutive CPUs folded into first-last
    for cpu in chosen[1:]:
        if cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def worker_environment(request: dict, allowed: set[int]) -> dict[str, str]:
    """What must be in os.environ before vllm is imported: vLLM reads these at import and
    in the engine process it spawns (which inherits them)."""
    return {
        "HF_HUB_OFFLINE": "1",           # the model folder is local; never reach a hub
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",      # vLLM reports usage to its servers unless told not to
        "VLLM_DO_NOT_TRACK": "1",
        "DO_NOT_TRACK": "1",
        # vLLM's processes talk over a message queue on the host's IP, which it finds by
        # routing towards 8.8.8.8 unless told; loopback keeps every byte on this machine
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOOPBACK_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": str(int(request["kv_cache_gib"])),  # GiB, an integer
        "VLLM_CPU_OMP_THREADS_BIND": cpu_binding(int(request["threads"]), allowed),
    }


def rounds_summary(seconds: list[float], output_tokens: list[int]) -> list[dict]:
    return [{"seconds": s, "output_tokens": n, "output_tokens_per_s": n / s}
            for s, n in zip(seconds, output_tokens)]


def generated_tokens(outputs, max_tokens: list[int]) -> list[list[int]]:
    """Each request's output token ids, in request order, checked to be exactly as many as
    asked for (ignore_eos: a short one would make the throughput a lie)."""
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    short = [(i, len(t), m) for i, (t, m) in enumerate(zip(tokens, max_tokens)) if len(t) != m]
    if short:
        raise RuntimeError(f"requests (index, produced, asked) short of max_tokens: {short[:5]}")
    return tokens


def main(request_path: str, result_path: str) -> int:
    stage = "request"
    result: dict = {}
    try:
        with open(request_path) as handle:
            request = read_request(handle.read())
        result["dtype"] = request["dtype"]
        os.environ.update(worker_environment(request, os.sched_getaffinity(0)))

        stage = "import"
        start = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        result.update(vllm_version=vllm.__version__, torch_version=torch.__version__,
                      import_seconds=time.perf_counter() - start,
                      omp_threads_bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"])

        stage = "start-up"
        start = time.perf_counter()
        optional = {k: request[k] for k in ("max_num_seqs", "max_num_batched_tokens") if request[k]}
        # prefix caching off: one engine serves every round, and a cached prefix would let
        # later rounds skip the prefill work the first round did
        llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                  enforce_eager=bool(request["enforce_eager"]), enable_prefix_caching=False, seed=0,
                  **optional)
        result["startup_seconds"] = time.perf_counter() - start

        stage = "warm-up"
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
        start = time.perf_counter()
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True),
                     use_tqdm=False)
        result["warmup_seconds"] = time.perf_counter() - start

        stage = "generate"
        max_tokens = [int(m) for m in request["max_tokens"]]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        seconds, counts, rounds_agree = [], [], True
        for round_index in range(int(request["rounds"])):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)  # every request at once
            seconds.append(time.perf_counter() - start)
            tokens = generated_tokens(outputs, max_tokens)
            counts.append(sum(len(t) for t in tokens))
            if round_index == 0:
                result["token_ids"] = tokens
            else:
                rounds_agree = rounds_agree and tokens == result["token_ids"]
        result.update(rounds=rounds_summary(seconds, counts), rounds_agree=rounds_agree,
                      requests=len(prompts), max_model_len=request["max_model_len"],
                      enforce_eager=bool(request["enforce_eager"]), threads=int(request["threads"]),
                      kv_cache_gib=int(request["kv_cache_gib"]))
        status = 0
    except BaseException as exc:  # noqa: BLE001 - the parent reads why from the result file
        traceback.print_exc()
        result.update(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500] if str(exc)
                      else type(exc).__name__, stage=stage)
        status = 1
    with open(result_path, "w") as handle:
        json.dump(result, handle)
    return status


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} REQUEST.json RESULT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
