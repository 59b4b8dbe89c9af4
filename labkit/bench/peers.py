"""Other engines on the same model file, for `labkit bench lowbit`.

`LlamaCpp` runs llama.cpp through llama-cpp-python (the `labkit[llamacpp]` extra, compiled
from source for this CPU by `make peers`) on the very GGUF file labkit loads, with the same
threads. `why_not_llama_cpp()` says why it cannot run here (then its rows are NOT_RUN).

`VLLMCpu` runs vLLM's CPU build on the batch workload. vLLM pins its own transformers and
torch, so it lives in a virtual environment of its own (`.venv-vllm`, made by `make peers`)
and runs as a subprocess: `vllm_worker.py`, run by that venv's python, gets the requests as
JSON and answers in JSON. vLLM is given a Hugging Face-format folder, made once from the
registry's GGUF by labkit's own transformers and dequantized to float32: the very weights
labkit's f32 mode holds, so float32 greedy tokens can be compared one for one.
`why_not_vllm()` says why it cannot run here.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from labkit.models import registry
from labkit.util.paths import cache_root

LLAMA_CPP_EXTRA = "pip install 'labkit[llamacpp]' (make peers)"


def why_not_llama_cpp() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed: {LLAMA_CPP_EXTRA}"
    return None


class LlamaCpp:
    """llama.cpp on the registry's GGUF file of `model_name`, greedy, one sequence."""

    def __init__(self, model_name: str, threads: int, context: int = 1024):
        import llama_cpp

        self.path = registry.gguf_path(model_name)
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_threads=threads, n_threads_batch=threads,
                                   n_ctx=context, logits_all=True, verbose=False)
        self.threads = threads
        self.version = llama_cpp.__version__
        self.system_info = llama_cpp.llama_print_system_info().decode().strip()

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens after `prompt` (the end-of-text token does not stop it)."""
        out = []
        for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == max_tokens:
                break
        return out

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] for every position of `ids`, in one evaluation."""
        self.llm.reset()
        self.llm.eval(ids)
        return torch.tensor(self.llm.scores[:len(ids)], dtype=torch.float32)

    def describe(self) -> dict:
        """What a record says of this peer: version, file, threads and the CPU features
        llama.cpp was built for (`llama_print_system_info`)."""
        features = dict(re.findall(r"(\w+) = (\w+)", self.system_info))
        return {"engine": "llama.cpp via llama-cpp-python", "version": self.version, "file": self.path.name,
                "threads": self.threads, "build": features}


# ---------------------------------------------------------------------------------------
# vLLM (CPU build), in its own venv

VLLM_PYTHON_VARIABLE = "LABKIT_VLLM_PYTHON"
VLLM_WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
# labkit/bench/peers.py -> the checkout holding the package (an editable install)
REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_IMPORT_TIMEOUT_S = 300    # a cold `import vllm` reads thousands of files
VLLM_RUN_TIMEOUT_S = 1800      # start-up (a minute or more) plus every round, on two cores
LOG_TAIL_LINES = 15


def vllm_python() -> Path:
    """`$LABKIT_VLLM_PYTHON`, else the python of the checkout's `.venv-vllm`."""
    chosen = os.environ.get(VLLM_PYTHON_VARIABLE)
    return Path(chosen).expanduser() if chosen else REPO_ROOT / ".venv-vllm" / "bin" / "python"


def why_not_vllm() -> str | None:
    """None when the vLLM venv's python imports vllm, else a one-line reason."""
    python = vllm_python()
    if not python.is_file():
        return f"no vLLM venv at {python}: make peers (or set {VLLM_PYTHON_VARIABLE})"
    return _import_failure(str(python))


@functools.lru_cache(maxsize=None)
def _import_failure(python: str) -> str | None:
    # cached: the import takes seconds and its answer does not change within a process
    try:
        proc = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True,
                              timeout=VLLM_IMPORT_TIMEOUT_S, env=_offline_environment())
    except subprocess.TimeoutExpired:
        return f"`{python} -c 'import vllm'` took more than {VLLM_IMPORT_TIMEOUT_S} s"
    except OSError as exc:
        return f"{python} does not run: {exc}"
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        return f"{python} cannot import vllm: {lines[-1]}"
    return None


def _offline_environment() -> dict[str, str]:
    """This environment, told never to reach a model hub or report usage."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def hf_model_dir(model_name: str) -> Path:
    """The Hugging Face-format folder (config, float32 safetensors, tokenizer) of the
    registry's model, made once from its GGUF and kept in the labkit cache.

    It is written to a temporary folder beside its place and renamed into it, so a folder
    that exists is complete; a second process racing to make it loses the rename and uses
    the winner's."""
    target = cache_root() / "hf" / model_name
    if (target / "config.json").is_file():
        return target
    gguf = registry.fetch(model_name)
    # the GGUF is local and a hub is never asked: the variable for a transformers not yet
    # imported, local_files_only for one that is (it reads the variable once, at import)
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    # transformers >= 5.2x keeps GGUF blocks packed (and then refuses to save them) unless
    # told to dequantize; older versions always dequantize and have no GgufConfig
    gguf_config = getattr(transformers, "GgufConfig", None)
    dense = {"quantization_config": gguf_config(dequantize=True)} if gguf_config else {}
    folder, local = str(gguf.parent), {"gguf_file": gguf.name, "local_files_only": True}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **local, **dense)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **local)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{model_name}-"))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is not
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


class VLLMCpu:
    """vLLM's CPU build on `model_name` (its float32 Hugging Face folder), greedy, every
    request of a batch submitted at once, in a subprocess of the vLLM venv's python.

    Each `run_batch` starts a fresh vLLM (start-up included in what it reports, not in its
    timings). A dtype vLLM refuses or fails in comes back as {"ok": False, "error": ...},
    and is listed as failed by `describe()`, so a bench records it instead of stopping."""

    def __init__(self, model_name: str, threads: int, kv_cache_gib: int = 1,
                 timeout_s: float = VLLM_RUN_TIMEOUT_S, log_dir: Path | None = None):
        self.model_name = model_name
        self.threads = threads
        self.kv_cache_gib = kv_cache_gib
        self.timeout_s = timeout_s
        self.python = vllm_python()
        self.model_dir = hf_model_dir(model_name)
        self.log_dir = Path(log_dir) if log_dir else cache_root() / "logs" / "vllm"
        self.results: dict[str, dict] = {}  # dtype -> the last run's result

    def request(self, prompts: list[list[int]], max_tokens: list[int], dtype: str, rounds: int,
                **engine_options) -> dict:
        """What the worker is sent (engine_options: max_num_seqs, max_num_batched_tokens,
        enforce_eager)."""
        return {"model_dir": str(self.model_dir), "dtype": dtype, "threads": self.threads,
                "prompts": [[int(t) for t in p] for p in prompts], "max_tokens": [int(m) for m in max_tokens],
                "rounds": rounds, "kv_cache_gib": self.kv_cache_gib, **engine_options}

    def run_batch(self, prompts: list[list[int]], max_tokens: list[int], dtype: str = "float32",
                  rounds: int = 1, **engine_options) -> dict:
        """Every request at once, `rounds` times, on one vLLM; the worker's result with
        "ok" (and on failure "error", the stage it failed in and the log's last lines)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        handle, log_name = tempfile.mkstemp(dir=self.log_dir, prefix=f"{self.model_name}-{dtype}-{stamp}-",
                                            suffix=".log")
        log = Path(log_name)
        spec = self.request(prompts, max_tokens, dtype, rounds, **engine_options)
        with tempfile.TemporaryDirectory(prefix="labkit-vllm-") as tmp, os.fdopen(handle, "w") as log_handle:
            request_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
            request_file.write_text(json.dumps(spec))
            start = time.perf_counter()
            command = [str(self.python), str(VLLM_WORKER), str(request_file), str(result_file)]
            status = _run_in_own_group(command, log_handle, tmp, self.timeout_s)
            result = json.loads(result_file.read_text()) if result_file.is_file() else {}
        result.update(dtype=dtype, log=str(log), process_seconds=time.perf_counter() - start)
        if status is None:
            result["error"] = f"the vLLM worker ran past {self.timeout_s:.0f} s"
        elif status != 0 and "error" not in result:
            result["error"] = f"the vLLM worker exited with status {status}"
        result["ok"] = "error" not in result
        if not result["ok"]:
            result["log_tail"] = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        self.results[dtype] = result
        return result

    def describe(self) -> dict:
        """What a record says of this peer: versions, the dtypes run (and why any failed),
        threads and start-up seconds."""
        done = {d: r for d, r in self.results.items() if r["ok"]}
        first = next(iter(done.values()), {})
        return {"engine": "vLLM (CPU build) in its own venv", "version": first.get("vllm_version"),
                "torch": first.get("torch_version"),
                "model": f"{self.model_dir.name} (float32 Hugging Face folder made from the registry's GGUF)",
                "dtypes": sorted(done),
                "failed": {d: r["error"] for d, r in self.results.items() if not r["ok"]},
                "threads": self.threads,
                "startup_seconds": {d: r.get("startup_seconds") for d, r in done.items()},
                "enforce_eager": first.get("enforce_eager"), "python": str(self.python)}


def _run_in_own_group(command: list[str], log_handle, cwd: str, timeout_s: float) -> int | None:
    """The exit status of `command` (None past `timeout_s`), its output to `log_handle`.

    vLLM starts an engine process and a worker process of its own; a timeout or an
    interrupt here must stop them too, or they keep both cores busy. So the worker leads a
    process group of its own, and the whole group is killed if it is still there."""
    proc = subprocess.Popen(command, stdout=log_handle, stderr=subprocess.STDOUT, cwd=cwd,
                            env=_offline_environment(), start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the worker left behind, if anything
        except ProcessLookupError:
            pass
        proc.wait()
