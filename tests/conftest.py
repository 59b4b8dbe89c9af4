"""Shared fixtures: the default model and its reference are loaded once per session."""

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))

PROMPTS = [
    "An inference engine takes a trained model and a request, and it must",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Les modèles de langage prédisent le prochain mot. 東京は日本の首都です。",
    "1, 2, 3, 5, 8, 13, 21,",
    "<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def model():
    from labkit.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def reference():
    from labkit.models.reference import load_reference

    return load_reference("smollm2-135m")
