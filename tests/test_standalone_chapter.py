"""A chapter opened alone runs, as Colab opens it: no checkout around it, labkit installed
from its built wheel (with the `colab` extra the install cell asks for) into a fresh venv,
the notebook executed in an empty folder. Its results land beside it, in `results/`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "requirements" / "constraints.txt"
# Two chapters: one that reads the model and its transformers reference, one that times
# matrix products on labkit's kernels.
CHAPTERS = ("ch01-what-is-inference", "ch06-building-our-first-inference-engine")


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd[:4]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_chapters_run_from_the_installed_wheel_in_an_empty_folder(tmp_path):
    source = tmp_path / "source"  # built from a copy: setuptools writes build/ beside the sources
    shutil.copytree(REPO / "labkit", source / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", wheels, source])
    wheel = next(wheels.glob("labkit-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    pip = [python, "-m", "pip", "install", "--quiet", "-c", CONSTRAINTS]
    run([*pip, "torch==2.13.0"])  # first, at its pin, so pip never resolves a CUDA build
    run([*pip, f"labkit[colab] @ {wheel.as_uri()}", "papermill", "ipykernel"])
    run([python, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"])

    reader = tmp_path / "reader"  # an empty folder: no _config.yml, no .git above it
    reader.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "LABKIT_RESULTS_DIR", "LABKIT_PROFILE", "VIRTUAL_ENV")}
    env.update(JUPYTER_PATH=str(venv / "share" / "jupyter"), LABKIT_HEADLESS="1",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    where = run([python, "-c", "import labkit; print(labkit.__file__)"], cwd=reader, env=env).stdout
    assert Path(where.strip()).is_relative_to(venv), where  # the wheel's labkit, not the checkout's

    for name in CHAPTERS:
        notebook = reader / f"{name}.ipynb"
        shutil.copy(REPO / "notebooks" / notebook.name, notebook)
        run([python, "-m", "papermill", notebook, reader / f"{name}.out.ipynb", "-p", "profile", "ci",
             "-k", "python3", "--cwd", reader], cwd=reader, env=env, timeout=1800)
        record = json.loads((reader / "results" / "_ci" / name[:4] / "metrics.json").read_text())
        assert record["profile"] == "ci" and record["metrics"]
        assert record["git_revision"] is None  # no repository around it: none is claimed
        assert record["environment"]["machine"]["caches"] is not None
