"""The book pipeline: profiles, results records, the generated toc, notebook pairs and the
install cell. Per-notebook checks run over whatever chapters exist in notebooks/."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest

from labkit.book import profile as prof
from labkit.book import runner
from labkit.book.results import NOT_RUN, Results, chapter_id, results_root
from labkit.util.environment import capture

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_MD = FIXTURES / "ch02-pipeline-fixture.md"

SOURCES = sorted((REPO / "notebooks").glob("ch*.md"))
NOTEBOOKS = sorted((REPO / "notebooks").glob("ch*.ipynb"))


def _ids(paths):
    return [p.stem for p in paths]


def unpaired(folder: Path) -> list[str]:
    """Chapter files in ``folder`` whose .md/.ipynb twin is missing."""
    md = {p.stem for p in folder.glob("ch*.md")}
    nb = {p.stem for p in folder.glob("ch*.ipynb")}
    return sorted([f"{s}.md (no .ipynb)" for s in md - nb] + [f"{s}.ipynb (no .md)" for s in nb - md])


def make_book_copy(tmp_path: Path, with_fixture: bool = True) -> Path:
    """A minimal copy of the book (config, front matter) with the fixture as a chapter."""
    root = tmp_path / "book-copy"
    root.mkdir()
    for name in ("_config.yml", "jupytext.toml"):
        shutil.copy(REPO / name, root / name)
    shutil.copytree(REPO / "book", root / "book")
    (root / "notebooks").mkdir()
    if with_fixture:
        shutil.copy(FIXTURE_MD, root / "notebooks" / FIXTURE_MD.name)
    return root


# --- profiles --------------------------------------------------------------------------

def test_profiles_and_validation(monkeypatch):
    assert set(prof.PROFILES) == {"ci", "full"}
    assert prof.current_profile("ci") == "ci"
    assert prof.current_profile(" FULL ") == "full"
    monkeypatch.delenv(prof.PROFILE_ENV, raising=False)
    assert prof.current_profile(None) == "ci"
    monkeypatch.setenv(prof.PROFILE_ENV, "full")
    assert prof.current_profile(None) == "full"
    with pytest.raises(ValueError, match="unknown profile"):
        prof.current_profile("fast")
    with pytest.raises(TypeError):
        prof.current_profile(3)
    assert prof.pick("ci", ci=8, full=64) == 8
    assert prof.pick("full", ci=8, full=64) == 64
    with pytest.raises(ValueError):
        prof.pick("gpu", ci=1, full=2)


def test_install_cell_comes_from_config():
    import yaml

    config = yaml.safe_load((REPO / "_config.yml").read_text())
    url = config["repository"]["url"]
    assert prof.repository_url(REPO) == url.rstrip("/")
    source = prof.install_cell_source(url, config["repository"]["branch"])
    assert "import labkit" in source and "except ImportError:" in source
    assert f'%pip install -q "labkit[colab] @ git+{url}@{config["repository"]["branch"]}"' in source
    assert prof.is_install_cell(source)
    with pytest.raises(ValueError):
        prof.install_cell_source("not a url")


# --- results -------------------------------------------------------------------------

def test_chapter_ids():
    assert chapter_id(1) == chapter_id("01") == chapter_id("ch01-what-is-inference") == "ch01"
    with pytest.raises(ValueError):
        chapter_id("intro")


def test_results_folders(monkeypatch, tmp_path):
    monkeypatch.delenv("LABKIT_RESULTS_DIR", raising=False)
    assert results_root("full", REPO) == REPO / "results"
    assert results_root("ci", REPO) == REPO / "results" / "_ci"
    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(tmp_path))
    assert results_root("full") == tmp_path
    assert results_root("ci") == tmp_path / "_ci"


def test_a_chapter_outside_a_checkout_writes_beside_itself(monkeypatch, tmp_path):
    """Colab, a downloaded notebook, labkit from a wheel: no _config.yml at or above the
    notebook and none beside the package. The results go to results/ in its folder."""
    from labkit.book import results as results_module

    def no_checkout(start=None):
        raise FileNotFoundError("no _config.yml found")

    monkeypatch.delenv("LABKIT_RESULTS_DIR", raising=False)
    monkeypatch.setattr(results_module, "find_repo_root", no_checkout)
    monkeypatch.chdir(tmp_path)
    assert results_root("ci") == tmp_path / "results" / "_ci"
    res = Results("ch06", profile="ci")
    assert res.dir == tmp_path / "results" / "_ci" / "ch06" and res.repo_root is None
    assert json.loads(res.write().read_text())["chapter"] == "ch06"


def test_a_machine_fact_is_glued_as_the_sentence_for_its_outcome(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(tmp_path))
    res = Results("ch07", profile="ci")
    fits = res.fact("head_in_cache", 113e6 < 300 * 2**20, "The head fits in the cache here.",
                    "The head is larger than every cache here.", note="L3 300 MiB")
    assert fits == "The head fits in the cache here."
    assert res.metrics["head_in_cache"] == {"value": True, "text": fits, "kind": "fact", "note": "L3 300 MiB"}
    import numpy as np

    assert res.fact("head_in_cache", np.bool_(False), "yes", "no") == "no"
    assert res.metrics["head_in_cache"]["value"] is False


def test_results_write_metrics_json(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from labkit.book.style import new_figure

    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(tmp_path))
    res = Results("ch01", profile="ci", model="smollm2-135m")
    assert res.dir == tmp_path / "_ci" / "ch01"
    res.workload(prompt="hello", max_new_tokens=16)
    assert res.metric("decode_tok_s", 12.345, unit="tokens/s", fmt="{:.1f}") == 12.345
    assert res.not_run("gpu_tok_s", "no CUDA device") == f"{NOT_RUN} (no CUDA device)"
    with pytest.raises(ValueError):
        res.not_run("x", "")
    note = res.not_run("c_kernel_text", "no C compiler", what="the C kernel")
    assert note == f"{NOT_RUN}: the C kernel did not run here (no C compiler)."
    assert res.not_run_reasons["c_kernel_text"] == "no C compiler"
    fig, ax = new_figure()
    ax.plot([0, 1], [0, 1])
    assert res.savefig(fig, "line") is None
    df = pd.DataFrame({"a": [1, 2]})
    assert res.table(df, "tbl").equals(df)
    path = res.write()

    assert path == tmp_path / "_ci" / "ch01" / "metrics.json"
    for name in ("line.png", "line.svg", "tbl.csv"):
        assert (res.dir / name).is_file()
    record = json.loads(path.read_text())
    assert record["chapter"] == "ch01" and record["profile"] == "ci"
    assert record["metrics"]["decode_tok_s"] == {"value": 12.345, "unit": "tokens/s", "text": "12.3"}
    assert record["not_run"] == {"gpu_tok_s": "no CUDA device", "c_kernel_text": "no C compiler"}
    assert record["workload"] == {"prompt": "hello", "max_new_tokens": 16}
    assert record["figures"] == ["line.png", "line.svg"] and record["tables"] == ["tbl.csv"]
    assert "git_revision" in record and "timestamp" in record
    assert record["git_revision"] is None or re.fullmatch(r"[0-9a-f]{40}", record["git_revision"])
    assert record["timestamp"].endswith("+00:00")
    env = record["environment"]
    for key in ("python", "platform", "cpu", "machine", "torch", "versions", "git", "model", "kernels"):
        assert key in env
    assert env["kernels"]["aten_cpu_capability"] and "memory_read" in env["machine"]
    assert env["cpu"]["logical_cores"] >= 1
    assert env["torch"]["num_threads"] >= 1
    assert env["versions"]["torch"]
    assert env["model"]["sha256"] and len(env["model"]["sha256"]) == 64
    assert env["git"]["revision"] == record["git_revision"]


def test_environment_has_no_hostname():
    import socket

    text = json.dumps(capture())
    host = socket.gethostname()
    assert len(host) < 4 or host not in text


# --- the table of contents -----------------------------------------------------------

def test_toc_is_up_to_date():
    assert runner.toc_is_current(REPO), (
        "_toc.yml does not match the notebooks on disk: run "
        "`python -c 'from labkit.book.runner import write_toc; write_toc()'` or `labkit book build`"
    )


def test_toc_generation(tmp_path):
    root = make_book_copy(tmp_path, with_fixture=False)
    for stem in ("ch01-a", "ch13-b", "ch45-c"):
        (root / "notebooks" / f"{stem}.ipynb").write_text("{}")
    text = runner.toc_text(root)
    import yaml

    toc = yaml.safe_load(text)
    assert toc["format"] == "jb-book" and toc["root"] == "book/intro"
    assert [p["caption"] for p in toc["parts"]] == [p[1] for p in runner.PARTS]
    files = [[c["file"] for c in part["chapters"]] for part in toc["parts"]]
    assert files[0] == ["book/part1", "notebooks/ch01-a"]
    assert files[1] == ["book/part2"]
    assert files[2] == ["book/part3", "notebooks/ch13-b"]
    assert files[7] == ["book/part8", "notebooks/ch45-c"]
    assert [runner.part_of(n) for n in (1, 6, 7, 12, 13, 18, 19, 24, 25, 30, 31, 35, 36, 40, 41, 45)] == [
        1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8]
    runner.write_toc(root)
    assert runner.toc_is_current(root)


# --- notebook pairs ------------------------------------------------------------------

def test_unpaired_detection(tmp_path):
    (tmp_path / "ch01-a.md").write_text("")
    (tmp_path / "ch01-a.ipynb").write_text("{}")
    (tmp_path / "ch02-b.md").write_text("")
    (tmp_path / "ch03-c.ipynb").write_text("{}")
    assert unpaired(tmp_path) == ["ch02-b.md (no .ipynb)", "ch03-c.ipynb (no .md)"]


def test_every_notebook_has_its_pair():
    assert unpaired(REPO / "notebooks") == []


def test_chapter_files_are_named_chNN_slug():
    for path in SOURCES + NOTEBOOKS:
        runner.chapter_number(path)  # raises for a bad name


@pytest.mark.parametrize("md_path", SOURCES, ids=_ids(SOURCES))
def test_first_code_cell_is_install_cell(md_path):
    expected = prof.install_cell_source(prof.repository_url(REPO), prof.repository_branch(REPO))
    for nb in (runner.read_source(md_path), runner.read_notebook(md_path.with_suffix(".ipynb"))):
        first = next(c for c in nb.cells if c.cell_type == "code")
        assert first.source == expected, "run labkit.book.runner.sync_install_cells()"
        assert "remove-cell" in first.metadata.get("tags", [])


def _profile_default(source: str):
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "profile" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


@pytest.mark.parametrize("md_path", SOURCES, ids=_ids(SOURCES))
def test_parameters_cell_defaults_to_ci(md_path):
    cell = runner.parameters_cell(runner.read_source(md_path))
    assert cell is not None, "a code cell tagged `parameters` is missing"
    assert _profile_default(cell.source) == "ci"
    assert cell.source == prof.PARAMETERS_SOURCE, "run labkit.book.runner.sync_install_cells()"


def test_colab_extra_is_pinned_to_the_tested_versions():
    """The install cell's extra pins each library to the version in constraints.txt, and
    leaves out the book-building tools."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    assert extras[prof.INSTALL_EXTRA], "the colab extra is empty"
    for requirement in extras[prof.INSTALL_EXTRA]:
        name, version = requirement.split("==")
        assert pins[name.lower()] == version, f"{requirement} differs from constraints.txt"
    names = {r.split("==")[0].lower() for r in extras[prof.INSTALL_EXTRA]}
    assert not names & {"jupyter-book", "pytest", "nbval", "torch"}
    assert f"labkit[{prof.INSTALL_EXTRA}]" in prof.install_cell_source("https://x.org/r", "main")


@pytest.mark.parametrize("md_path", SOURCES, ids=_ids(SOURCES))
def test_setup_shows_which_profile_made_the_numbers(md_path):
    text = md_path.read_text(encoding="utf-8")
    assert "show_profile_note(profile)" in text


@pytest.mark.parametrize("ipynb_path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_has_stored_outputs_and_no_errors(ipynb_path):
    nb = runner.read_notebook(ipynb_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any(c.get("outputs") for c in code), "no stored outputs: run `labkit book run`"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, "a stored output is an error"
    assert "papermill" not in nb.metadata
    assert all("papermill" not in c.metadata and "execution" not in c.metadata for c in nb.cells)


@pytest.mark.parametrize("ipynb_path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_stored_outputs_glue_each_key_once(ipynb_path):
    # myst-nb warns on a key glued twice, and the strict build fails on that warning
    nb = runner.read_notebook(ipynb_path)
    names = [o["metadata"]["scrapbook"]["name"] for c in nb.cells if c.cell_type == "code"
             for o in c.get("outputs", []) if "scrapbook" in o.get("metadata", {})]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"glued more than once in one run: {twice}"


@pytest.mark.parametrize("md_path", SOURCES, ids=_ids(SOURCES))
def test_md_and_ipynb_inputs_in_sync(md_path):
    md_cells = runner.cell_inputs(runner.read_source(md_path))
    nb_cells = runner.cell_inputs(runner.read_notebook(md_path.with_suffix(".ipynb")))
    assert md_cells == nb_cells, (
        f"{md_path.name} and its .ipynb differ: run "
        f"`python -c 'from labkit.book.runner import sync_pair; sync_pair(\"{md_path}\")'`"
    )


# --- pipeline pieces on the fixture ----------------------------------------------------

def test_sync_install_cells_and_pair(tmp_path):
    root = make_book_copy(tmp_path)
    md = root / "notebooks" / FIXTURE_MD.name
    changed = runner.sync_install_cells(root)
    assert changed == [md]
    assert runner.sync_install_cells(root) == []  # idempotent
    first = next(c for c in runner.read_source(md).cells if c.cell_type == "code")
    assert first.source == prof.install_cell_source(prof.repository_url(root),
                                                    prof.repository_branch(root))
    assert first.metadata["tags"] == ["remove-cell"]
    runner.sync_pair(md)
    assert runner.pair_in_sync(md)
    # The md stays the source: an edit there reaches the ipynb.
    md.write_text(md.read_text().replace("Pipeline fixture", "Pipeline fixture, edited"))
    assert not runner.pair_in_sync(md)
    runner.sync_pair(md)
    assert runner.pair_in_sync(md)


def test_sync_drops_the_outputs_of_an_edited_code_cell_only(tmp_path):
    """An edited code cell must not keep the outputs its old text produced (they would be
    shown, glued and checked as the new code's); unchanged cells keep theirs."""
    import nbformat

    root = make_book_copy(tmp_path)
    md = root / "notebooks" / FIXTURE_MD.name
    ipynb = runner.sync_pair(md)
    notebook = nbformat.read(ipynb, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    for number, cell in enumerate(code, start=1):
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {number}\n")]
        cell.execution_count = number
    nbformat.write(notebook, ipynb)
    edited = next(c for c in code if "total = sum(" in c.source)
    md.write_text(md.read_text().replace("total = sum(i * i", "total = sum(i ** 2"))
    runner.sync_pair(md)
    synced = [c for c in nbformat.read(ipynb, as_version=4).cells if c.cell_type == "code"]
    assert len(synced) == len(code) and runner.pair_in_sync(md)
    for old, new in zip(code, synced):
        if old is edited:
            assert "i ** 2" in new.source and new.outputs == [] and new.execution_count is None
        else:
            assert new.source == old.source and new.outputs == old.outputs


def test_the_sync_command_carries_edited_cells_into_the_notebook(tmp_path, monkeypatch):
    """`labkit book sync` after editing a chapter's .md: its .ipynb has the edited cells
    (it used to rewrite only the install cells and leave an edited chapter out of step)."""
    from labkit.cli import main

    root = make_book_copy(tmp_path)
    md = root / "notebooks" / FIXTURE_MD.name
    monkeypatch.chdir(root)
    assert main(["book", "sync"]) == 0 and runner.pair_in_sync(md)
    md.write_text(md.read_text().replace("Pipeline fixture", "Pipeline fixture, edited"))
    assert not runner.pair_in_sync(md)
    assert main(["book", "sync", "2"]) == 0
    assert runner.pair_in_sync(md)


def test_strip_execution_metadata():
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[
        new_code_cell("profile = 'ci'", metadata={"tags": ["parameters"]}),
        new_code_cell("profile = 'full'", metadata={"tags": ["injected-parameters"]}),
        new_code_cell("x = 1", metadata={"tags": [], "papermill": {"status": "completed"},
                                          "execution": {"iopub.status.busy": "t"},
                                          "ExecuteTime": {}}),
    ], metadata={"papermill": {"parameters": {}}, "kernelspec": {"name": "python3", "display_name": "Python 3"}})
    runner.strip_execution_metadata(nb)
    assert [c.source for c in nb.cells] == ["profile = 'ci'", "x = 1"]
    assert nb.cells[1].metadata == {}
    assert "papermill" not in nb.metadata and "kernelspec" in nb.metadata
    nbformat.validate(nb)


def test_resolve_chapters(tmp_path):
    root = make_book_copy(tmp_path)
    md = root / "notebooks" / FIXTURE_MD.name
    for selector in ("2", "02", "ch02", "pipeline-fixture", "ch02-pipeline-fixture", str(md)):
        assert runner.resolve_chapters([selector], root) == [md]
    assert runner.resolve_chapters(None, root) == [md]
    with pytest.raises(ValueError):
        runner.resolve_chapters(["7"], root)
    assert runner.run_chapters("ci", ["7"], root=root, log=None) == 2
    assert runner.run_chapters("fast", root=root, log=None) == 2
    with pytest.raises(ValueError):
        runner.run_chapters("fast", root=root, log=None, raise_on_failure=True)


@pytest.mark.slow
def test_run_and_build_fixture_book(tmp_path, monkeypatch):
    """End to end: papermill runs the fixture chapter (full profile), the pair stays in
    sync without papermill metadata, and the book builds with -W (zero warnings)."""
    root = make_book_copy(tmp_path)
    # What `make peers` and the vLLM venv leave in the checkout: Markdown that is not the
    # book's, with headings Sphinx warns about. The book's sources are its own folders only.
    for folder in (".peers/llama_cpp_python-0.3.36/vendor", ".venv-vllm/lib/site-packages/pkg", ".venv/share"):
        (root / folder).mkdir(parents=True)
        (root / folder / "README.md").write_text("# A peer\n\n### Skipped a level\n\nNot a page.\n")
    monkeypatch.delenv("LABKIT_RESULTS_DIR", raising=False)
    runs = runner.execute_chapters("full", root=root, timeout=300, log=None)
    assert [r.ok for r in runs] == [True], runs
    md = root / "notebooks" / FIXTURE_MD.name
    ipynb = md.with_suffix(".ipynb")
    assert runner.pair_in_sync(md)
    assert "injected-parameters" not in ipynb.read_text()
    assert '"papermill": {' not in ipynb.read_text()
    record = json.loads((root / "results" / "ch02" / "metrics.json").read_text())
    assert record["profile"] == "full" and record["metrics"]["fixture_sum"]["text"] == "385"
    assert runner.toc_is_current(root)
    assert runner.build_book(root=root, log=None) == 0
    html = (root / "_build" / "html" / "notebooks" / "ch02-pipeline-fixture.html").read_text()
    assert "NOT_RUN (no CUDA device)" in html and ">385<" in html
    assert "%pip install" not in html  # the install cell is removed from the page
    assert "Figure 1" in html
    # Every script the page loads is served by the built site: MathJax included, no CDN.
    sources = re.findall(r'<script[^>]*\bsrc="([^"]+)"', html)
    assert any("_static/mathjax/tex-chtml-full.js" in s for s in sources), sources
    assert not [s for s in sources if s.startswith(("http:", "https:", "//"))], sources
    styles = [t for t in re.findall(r"<link[^>]*>", html) if "stylesheet" in t]
    assert styles and not [t for t in styles if re.search(r'href="(https?:)?//', t)], styles
    assert (root / "_build" / "html" / "_static" / "mathjax" / "output" / "chtml" / "fonts"
            / "woff-v2" / "MathJax_Main-Regular.woff").is_file()
