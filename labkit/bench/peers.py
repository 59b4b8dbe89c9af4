"""Other engines on the same model file, for `labkit bench lowbit`.

`LlamaCpp` runs llama.cpp through llama-cpp-python (the `labkit[llamacpp]` extra, compiled
from source for this CPU by `make peers`) on the very GGUF file labkit loads, with the same
threads. `why_not_llama_cpp()` says why it cannot run here (then its rows are NOT_RUN).
"""

from __future__ import annotations

import importlib.util
import re

import torch

from labkit.models import registry

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
