"""vLLM's CPU build as a peer engine (`labkit.bench.peers.VLLMCpu`, `vllm_worker.py`).

The fast tests need no vLLM: they check the reason given when its venv is missing, the
worker's request checks and environment, and that a failing worker comes back as a failed
dtype with its reason (labkit's own python, which has no vllm, stands in for the vLLM venv's).
The slow test runs the real worker and holds vLLM's greedy tokens in float32 to labkit's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit.bench import peers, vllm_worker


def importlib_finds(name: str) -> bool:
    """Whether labkit's own python has `name` (then it cannot stand in for a venv without it)."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


def request(**changes) -> dict:
    spec = {"model_dir": "/nowhere", "dtype": "float32", "threads": 2, "prompts": [[1, 2, 3], [4, 5]],
            "max_tokens": [8, 16], "rounds": 1, "kv_cache_gib": 1}
    return {**spec, **changes}


def test_missing_vllm_venv_is_named_with_the_fix(monkeypatch, tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    monkeypatch.setenv(peers.VLLM_PYTHON_VARIABLE, str(missing))
    reason = peers.why_not_vllm()
    assert reason is not None and str(missing) in reason and "make peers" in reason
    assert "\n" not in reason


def test_a_python_without_vllm_is_named_with_the_import_error(monkeypatch):
    monkeypatch.setenv(peers.VLLM_PYTHON_VARIABLE, sys.executable)
    if importlib_finds("vllm"):
        pytest.skip("labkit's own python has vllm, so it cannot stand in for a broken venv")
    reason = peers.why_not_vllm()
    assert reason is not None and "cannot import vllm" in reason and "vllm" in reason.split(":")[-1]


def test_request_gets_defaults_and_the_context_it_needs():
    checked = vllm_worker.read_request(json.dumps(request()))
    assert checked["max_model_len"] == max(3 + 8, 2 + 16)
    assert checked["enforce_eager"] is True and checked["max_num_seqs"] is None
    assert vllm_worker.read_request(json.dumps(request(enforce_eager=False)))["enforce_eager"] is False


@pytest.mark.parametrize("changes, complaint", [
    ({"dtype": "float16"}, "dtype"),
    ({"max_tokens": [8]}, "max_tokens"),
    ({"prompts": [[1], []], "max_tokens": [1, 1]}, "every prompt"),
    ({"threads": 0}, "at least 1"),
])
def test_a_bad_request_is_refused_before_vllm_starts(changes, complaint):
    with pytest.raises(ValueError, match=complaint):
        vllm_worker.read_request(json.dumps(request(**changes)))


def test_a_request_missing_fields_names_them():
    spec = request()
    del spec["rounds"], spec["kv_cache_gib"]
    with pytest.raises(ValueError, match="rounds, kv_cache_gib"):
        vllm_worker.read_request(json.dumps(spec))


@pytest.mark.parametrize("threads, allowed, binding", [
    (2, {0, 1}, "0-1"), (1, {0, 1}, "0"), (3, {4, 5, 6, 7}, "4-6"), (4, {0, 1, 2, 5, 6, 9}, "0-2,5"),
])
def test_threads_are_bound_to_the_lowest_allowed_cpus(threads, allowed, binding):
    assert vllm_worker.cpu_binding(threads, allowed) == binding


def test_more_threads_than_cpus_is_refused():
    with pytest.raises(ValueError, match="only CPUs"):
        vllm_worker.cpu_binding(3, {0, 1})


def test_worker_environment_is_offline_on_loopback_and_sized():
    checked = vllm_worker.read_request(json.dumps(request(kv_cache_gib=3)))
    env = vllm_worker.worker_environment(checked, {0, 1})
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["DO_NOT_TRACK"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_rounds_summary_gives_rates():
    assert vllm_worker.rounds_summary([2.0, 4.0], [64, 64]) == [
        {"seconds": 2.0, "output_tokens": 64, "output_tokens_per_s": 32.0},
        {"seconds": 4.0, "output_tokens": 64, "output_tokens_per_s": 16.0}]


@pytest.mark.parametrize("spec, stage, error", [
    (request(dtype="int8"), "request", "ValueError"),
    (request(), "import", "ModuleNotFoundError"),
])
def test_worker_writes_its_failure_as_json(tmp_path, spec, stage, error):
    if importlib_finds("vllm"):
        pytest.skip("labkit's own python has vllm")
    request_file, result_file = tmp_path / "request.json", tmp_path / "result.json"
    request_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(peers.VLLM_WORKER), str(request_file), str(result_file)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    result = json.loads(result_file.read_text())
    assert result["stage"] == stage and result["error"].startswith(error)


def test_a_failing_dtype_is_reported_not_raised(monkeypatch, tmp_path):
    """The worker dies importing vllm (labkit's python has none): run_batch says so, with
    the log's tail, and describe() lists the dtype as failed."""
    if importlib_finds("vllm"):
        pytest.skip("labkit's own python has vllm")
    monkeypatch.setenv(peers.VLLM_PYTHON_VARIABLE, sys.executable)
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    folder = tmp_path / "hf" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # an existing folder is taken as made
    peer = peers.VLLMCpu("smollm2-135m", threads=1, log_dir=tmp_path / "logs")
    result = peer.run_batch([[1, 2, 3]], [4], dtype="bfloat16")
    assert result["ok"] is False and result["stage"] == "import" and "vllm" in result["error"]
    assert any("ModuleNotFoundError" in line for line in result["log_tail"])
    described = peer.describe()
    assert described["dtypes"] == [] and "bfloat16" in described["failed"]


@pytest.mark.slow
def test_vllm_greedy_tokens_equal_labkit_f32(model):
    """vLLM in float32 on the dequantized GGUF weights picks the same greedy tokens as
    labkit's f32 engine on the same weights, up to the near-tie rule (two implementations:
    labkit's top-20 log-probabilities are the reference's scores, its error against
    transformers the stated bound)."""
    why_not = peers.why_not_vllm()
    if why_not is not None:
        pytest.skip(why_not)
    import torch

    from dataclasses import replace

    from conftest import SMOL_LOGIT_ERROR, assert_greedy_near
    from labkit.bench.serving import greedy_params
    from labkit.engine.llm_engine import EngineConfig, LLMEngine

    prompts = [model.tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):\n")]
    result = peers.VLLMCpu("smollm2-135m", threads=torch.get_num_threads()).run_batch(prompts, [8, 8])
    assert result["ok"], f"{result.get('error')}\n" + "\n".join(result.get("log_tail", []))
    ours = [out.samples[0] for out in LLMEngine(model, EngineConfig(weights="f32"))
            .generate(prompts, replace(greedy_params(8), logprobs=20))]
    assert_greedy_near([s.token_ids for s in ours], result["token_ids"], [s.top_logprobs for s in ours],
                       SMOL_LOGIT_ERROR, what="vLLM against labkit's f32 engine")
    assert result["rounds"][0]["output_tokens"] == 16 and result["startup_seconds"] > 0
