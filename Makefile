# The two commands of the README are `make book` and `make test`. Both create
# the virtual environment .venv with the machine's python3 and install the
# pinned stack into it first, so they work on a fresh clone.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# nbval executes the chapters; solutions/ and exercises/ are executed once, by the grader's
# tests (tests/test_grade_*.py), which fail on any cell error as nbval would, and check scores.
NOTEBOOKS := chapters
PYTEST_NOTEBOOK_FLAGS := --nbval-lax --nbval-current-env \
	--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600

.PHONY: install book test test-fast test-slow test-py313 test-colab test-accelerator notebooks exercises grade bench margins lint lock clean

# Byte-code is compiled once, here, in parallel: the suite starts ~150 Python processes
# (kernels, servers, builders, workers), and where PYTHONDONTWRITEBYTECODE is set (as on CI)
# none of them could cache it, so each would compile jax anew (3.2 s to import jax, flax,
# optax and stacklib without .pyc files, 1.1 s with them).
# Installed (tunix and qwix depend on them) but imported by none of the suite's processes: a
# third of the files, left uncompiled.
NEVER_IMPORTED := /site-packages/(transformers|tensorflow_datasets|datasets|sympy|numba|llvmlite)/

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e ".[book,test]"
	$(BIN)/python -m compileall -q -j 0 -x "$(NEVER_IMPORTED)" $(VENV)/lib stacklib benchmarks > /dev/null
	touch $(STAMP)

install: $(STAMP)  ## create .venv with the pinned stack and stacklib (editable)

book: $(STAMP)  ## execute the chapters (cached) and build the HTML book into _build/html
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going

# Two workers, a file each at a time (a notebook's cells share one kernel). `make test
# PYTEST_XDIST="-p no:xdist"` runs everything in one process, in another order.
PYTEST_XDIST ?= -n 2 --dist loadfile

# XLA's CPU compiler spends most of its time in LLVM's optimisation passes, and most of the
# suite compiles small programs it runs once: at -O1 (the default is -O2) the compile-bound
# tests take 47 s instead of 81 s, and a training notebook runs as fast as at -O2 (at -O0 it
# ran 10% slower). XLA's newer CPU fusion emitters cost more to compile than they save here:
# with them off, a small program (an eager op, an initializer) compiles in half the time (160 of
# them: 8.1 s -> 4.4 s), a training step ~10% faster, and runs as fast; a whole run takes 19%
# less CPU (user time 1834 s -> 1489 s, same machine). Scatters become loops then: the few tests
# and graders that read the optimized HLO's structure compile with XLA's defaults
# (compiler_options). Numerics differ in the last bits, as under another device count: every
# demo holds with a margin across seeds and device counts, and zoo models are always built
# with XLA's defaults (stacklib/checkpoint/zoo.py drops XLA_FLAGS). `make book` uses the defaults.
#
# The suite's ~150 processes (notebooks, graders, servers, command lines, job processes) compile
# many of the same programs: a chapter, its solutions and its exercises run the same checks, two
# processes of one job the same step. JAX's persistent compilation cache lets each program be
# compiled once per run and loaded from disk after (every size: min compile time 0); a loaded
# program is the compiled one, byte for byte, and is still a compilation to jax.monitoring, so
# stacklib.compile counts it. `make test` starts it empty, as on a new machine. Zoo builds use it
# too (with XLA's default flags, which are part of the key, so they load only what a build
# compiled): the tests' repeated builds of one tiny config compile once (test_llm's zoo test:
# 50 s -> 30 s of CPU).
XLA_CACHE := .jax_cache
TEST_ENV := JAX_PLATFORMS=cpu XLA_FLAGS="--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false" \
	JAX_COMPILATION_CACHE_DIR=$(CURDIR)/$(XLA_CACHE) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1

test: $(STAMP)  ## everything: units, parity, grading, every notebook, structural book build
	rm -rf $(XLA_CACHE)
	$(TEST_ENV) $(BIN)/python -m pytest $(PYTEST_XDIST) --build-zoo-first --durations=25 \
		$(PYTEST_NOTEBOOK_FLAGS) tests $(NOTEBOOKS)

test-fast: $(STAMP)  ## the Python tests only, without executing notebooks or building the book
	$(TEST_ENV) $(BIN)/python -m pytest -n 2 --dist loadfile -m "not slow" tests

# The property tests draw their cases with a fixed seed: `make test` tries 30 engine schedules
# (about 15 s), this tries 300 (a few minutes), the ones a change to the scheduler should face.
test-slow: $(STAMP)  ## the property tests at ten times as many examples
	STACKLIB_SLOW_TESTS=1 $(TEST_ENV) $(BIN)/python -m pytest -p no:xdist tests/test_infer_schedules.py

# Colab runs Python 3.13: the same pinned stack in a second venv, the Python tests (not the
# slow ones) and chapters 00, 01, 12, 14 with their solutions and exercises. Not part of `make
# test` (it would break its 15-minute budget). On a pyenv machine python3.13 is found under
# ~/.pyenv/versions; elsewhere pass PYTHON313=/path/to/python3.13.
PYTHON313 ?= $(or $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13)),python3.13)
VENV313 := .venv313
STAMP313 := $(VENV313)/.installed-stamp
PY313_NOTEBOOKS := 00_how_to_use 01_transforms 12_llm_training 14_inference

$(STAMP313): pyproject.toml constraints.txt
	$(PYTHON313) -m venv $(VENV313)
	$(VENV313)/bin/python -m pip install --quiet --upgrade pip
	$(VENV313)/bin/python -m pip install --quiet --no-compile -c constraints.txt -e ".[book,test]"
	$(VENV313)/bin/python -m compileall -q -j 0 $(VENV313)/lib > /dev/null
	touch $(STAMP313)

test-py313: $(STAMP313)  ## the Python tests and chapters 00, 01, 12, 14 (+ exercises) on Python 3.13
	$(TEST_ENV) $(VENV313)/bin/python -m pytest -n 2 --dist loadfile $(PYTEST_NOTEBOOK_FLAGS) \
		-m "not slow" tests $(PY313_NOTEBOOKS:%=chapters/%.ipynb)
	$(TEST_ENV) $(VENV313)/bin/python -m pytest -n 2 --dist loadfile tests/test_grade_solutions.py \
		tests/test_grade_exercises.py -k "$(subst $(eval) , or ,$(PY313_NOTEBOOKS))"

# A reader's first run on Colab, simulated (tests/colab/simulate.py): a Python 3.13 venv with the
# Colab TPU image's versions of every package the book's closure shares with it (from
# $(COLAB_IMAGES)/pip-freeze.tpu.txt; built once into .venv-colab/), a stub google.colab, the
# setup cell's git URL sent to a snapshot of this working tree, then chapters 00, 07, 12, 13, 14
# and 17 as a reader runs them, restart included; and the TPU and CUDA requirements resolved with
# pip --dry-run (on the GPU image's CUDA libraries). Not part of `make test`: 16 minutes on a
# 2-core CPU (979 s), plus 5 to build the image the first time. `make test-colab COLAB_REF=<commit>`
# simulates that commit's tree instead: at a34de76, before issue 39, it fails (the setup cell
# replaced ipykernel, jupyter_client and ipywidgets under the running kernel and left numpy,
# scipy, scikit-learn and ~50 more packages off the lock).
COLAB_IMAGES ?= ../shared/colab

test-colab: $(STAMP)  ## simulate a reader's first run on Colab's TPU image: setup, restart, chapters 00 07 12 13 14 17
	$(BIN)/python tests/colab/simulate.py --python313 $(PYTHON313) --images $(COLAB_IMAGES) $(COLAB_REF:%=--ref %)

# On a GPU or TPU (or a Colab TPU runtime: benchmarks/run_accelerator_tests.ipynb): install the
# accelerator build of the pinned JAX, then tests/accelerator (native Pallas kernels, chapter 12's
# MFU, the serving benchmarks) and every chapter at its accelerator row. Where JAX sees only a
# CPU, the accelerator tests are reported as skipped and no chapter runs: nothing passes vacuously.
test-accelerator: $(STAMP)  ## on a GPU/TPU: chapters at accelerator sizes, native kernels, MFU, benchmarks
	$(BIN)/python -c "from stacklib import hw; print('accelerator build:', hw.install_accelerator_support())"
	@backend=$$($(BIN)/python -c "import jax; print(jax.default_backend())"); \
	if [ "$$backend" = cpu ]; then \
		$(BIN)/python -m pytest -rs -p no:xdist tests/accelerator; \
		echo "make test-accelerator: SKIPPED, JAX sees no GPU or TPU here; no chapter ran at accelerator sizes."; \
	else \
		$(BIN)/python -m pytest -rs -p no:xdist tests/accelerator $(PYTEST_NOTEBOOK_FLAGS) chapters; \
	fi

notebooks: $(STAMP)  ## regenerate each chapter's .ipynb from its edited .md twin (or the reverse)
	$(BIN)/jupytext --sync chapters/*.md

exercises: $(STAMP)  ## regenerate exercises/ from solutions/ (solution code removed)
	$(BIN)/python -m stacklib.grading strip solutions exercises

grade: $(STAMP)  ## grade a folder of submitted notebooks: make grade DIR=submissions OUT=scores
	$(BIN)/python -m stacklib.grading grade $(or $(DIR),submissions) --out $(or $(OUT),scores)

bench: $(STAMP)  ## benchmarks against the real libraries, printed as ratios: make bench [ONLY=optim]
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks $(ONLY)

margins: $(STAMP)  ## how far a chapter's asserts are from failing, over seeds and device setups: make margins CHAPTER=13
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.demo_margins $(or $(CHAPTER),13)

lint: $(STAMP)
	$(BIN)/ruff check stacklib tests benchmarks

lock:  ## re-resolve constraints.txt from pyproject.toml in a throwaway venv
	set -e; tmp=$$(mktemp -d); \
	$(PYTHON) -m venv $$tmp/venv; \
	$$tmp/venv/bin/python -m pip install --quiet --upgrade pip; \
	$$tmp/venv/bin/python -m pip install --quiet ".[book,test]"; \
	( echo "# Generated by 'make lock' with Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'); do not edit by hand."; \
	  $$tmp/venv/bin/python -m pip freeze --exclude stacklib | grep -v '^-e' ) > constraints.txt; \
	rm -rf $$tmp build

clean:
	rm -rf _build .pytest_cache $(XLA_CACHE)
