# Every target works on a fresh clone: the first one run creates .venv and installs into it.
VENV   := .venv
BIN    := $(VENV)/bin
PYTHON ?= python3
.DEFAULT_GOAL := help

.PHONY: help test lint typecheck docs docs-serve unit test-slow test-gpu bench-gpu demo bench \
	dist compat fuzz mutate mutate-apis clean

# `make help`: every target with its one line, the text after `##` on the target's line
# (tests/test_makefile.py checks that every target has one).
help:  ## list the targets
	@awk -F':.*## ' '/^[a-z][a-z-]*:.*## / { printf "  make %-12s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

# The C walk is built by the editable install: a change to its source installs again.
$(BIN)/.installed: pyproject.toml requirements-dev.txt requirements-torchft.txt \
		src/torchcontract/_walk_native.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-dev.txt \
		-r requirements-torchft.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

# `make test` times itself, creating .venv included on a fresh clone: tools/record_run.py
# writes how long it took, with the counts of its pytest run, into docs/generated/test.md and
# the README (nothing there is by hand).
test:  ## lint, typecheck, docs and unit: what CI runs; records its time
	@started=$$(date +%s); fresh=$$(test -f $(BIN)/.installed || echo --fresh); \
	$(MAKE) --no-print-directory $(BIN)/.installed lint typecheck docs unit && \
	$(BIN)/python tools/record_run.py test .unit.xml --started $$started $$fresh

lint: $(BIN)/.installed  ## ruff check, ruff format --check and lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(BIN)/.installed  ## mypy --strict and basedpyright strict
	$(BIN)/mypy
	$(BIN)/mypy --disallow-any-expr examples
	$(BIN)/basedpyright

# The documentation site, into site/: strict, so a broken link, a missing reference entry or
# a docstring that does not render fails the build. tests/test_docs.py runs the pages' code.
docs: $(BIN)/.installed  ## the documentation site into site/, mkdocs build --strict
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The site served with live reload, search included; site/index.html also opens straight from
# the disk, every page and link but search (a browser lets no file:// page read its index).
docs-serve: $(BIN)/.installed  ## serve the documentation site on http://127.0.0.1:8000
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

# pytest-xdist, one worker per core; --dist loadfile keeps each test file on one worker,
# so module-scoped fixtures (the in-process process groups, each file's ranks) are set up
# once, as in a serial run. Every distributed test picks free ports. The slowest tests are
# listed at the end; docs/generated/unit.md gets the counts and the time. The tests marked
# `slow` (minutes each: torchrun restarts and nodes, torchft under HSDP, 8 ranks) are
# `make test-slow`'s, which CI runs after `make test`.
PYTEST_XDIST := $(BIN)/pytest -q -n auto --dist loadfile --durations=15
unit: $(BIN)/.installed  ## pytest: unit, typing, distributed (gloo on CPU) and docs tests
	@$(BIN)/python -c 'import platform, torch; print(f"testing against torch {torch.__version__} (Python {platform.python_version()})")'
	$(PYTEST_XDIST) -m 'not slow and not gpu' --junitxml=.unit.xml; \
		status=$$?; $(BIN)/python tools/record_run.py unit .unit.xml; exit $$status

test-slow: $(BIN)/.installed  ## the slow tests: torchrun, torchft under HSDP, 8 ranks (CI runs them)
	$(PYTEST_XDIST) -m 'slow and not gpu' --junitxml=.slow.xml; \
		status=$$?; $(BIN)/python tools/record_run.py slow .slow.xml; exit $$status

# On a machine with CUDA: the tests that fit one device (pytest marker "gpu", which every
# other run deselects): parity with FSDP2 and DDP, fully_shard's communication streams, and
# the GPU guide's script on every device;
# without CUDA they are skipped, and the command says so. Not in `make test` or CI.
# `make bench-gpu`: fully_shard beside FSDP2 on one GPU (step time, peak memory), into
# benchmarks/results/gpu.md, which the performance page includes; under 4 minutes on an H200.
# Both run on a machine with torch but no .venv (a GPU machine): with TORCHCONTRACT_PYTHON set
# (`make test-gpu TORCHCONTRACT_PYTHON=python3`), or when there is no .venv, they run that
# python (python3 by default) with PYTHONPATH=src, needing only torch, attrs,
# typing-extensions and pytest, and never create .venv; otherwise they run .venv's.
TORCHCONTRACT_PYTHON ?= $(if $(wildcard $(VENV)),,python3)
GPU_PYTHON := $(if $(TORCHCONTRACT_PYTHON),env PYTHONPATH=src $(TORCHCONTRACT_PYTHON),$(BIN)/python)
GPU_NEEDS := $(if $(TORCHCONTRACT_PYTHON),,$(BIN)/.installed)
GPU_TESTS := tests/distributed/test_cuda_parity.py tests/distributed/test_cuda_streams.py \
	tests/distributed/test_cuda_overlap.py tests/distributed/test_replicate_mirror_world.py \
	tests/distributed/test_gpu_guide_torchrun.py
# pytest-timeout may be missing there: the run is bounded by `timeout` (8 minutes), and a
# test hung for 2 minutes has every thread's stack printed (pytest's faulthandler).
test-gpu: $(GPU_NEEDS)  ## the gpu-marked tests on one CUDA device (skipped without CUDA)
	timeout -k 10 480 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu -rs \
		-o faulthandler_timeout=120 $(GPU_TESTS)

bench-gpu: $(GPU_NEEDS)  ## fully_shard beside FSDP2 on one GPU; writes benchmarks/results/gpu.md
	$(GPU_PYTHON) benchmarks/bench_gpu.py

# `make demo DEMO_ARGS=--hsdp`: fully_shard as HSDP on 4 processes (2 replicas x 2 shards).
DEMO_ARGS ?=
demo: $(BIN)/.installed  ## train a small GPT on 2 gloo processes (DEMO_ARGS=--hsdp: 4)
	$(BIN)/python -m torchcontract.demo $(DEMO_ARGS)

bench: $(BIN)/.installed  ## the benchmarks against torch; writes benchmarks/results/
	$(BIN)/python -m benchmarks.report

dist: $(BIN)/.installed  ## sdist and wheel into dist/, checked by twine check --strict
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/twine check --strict dist/*

# The tests against several torch releases, each in its own cached venv outside the repo.
compat:  ## the test suite against several torch releases; writes docs/generated/compat/
	bash tools/compat.sh

# Before a release, not in CI: the property and stateful tests with random seeds, ten
# times the examples and four times the stateful steps (profile "fuzz", tests/conftest.py).
FUZZED := tests/test_fqn_properties.py tests/test_store_stateful.py tests/test_bad_input.py \
	tests/test_store.py tests/test_state.py tests/test_contract.py tests/test_registry.py \
	tests/test_rules.py tests/test_describe.py tests/test_replicate_buckets.py
fuzz: $(BIN)/.installed  ## property and stateful tests, random seeds, 10x the examples
	TORCHCONTRACT_HYPOTHESIS_PROFILE=fuzz $(BIN)/pytest -q -p no:cacheprovider \
		--hypothesis-show-statistics --junitxml=.fuzz.xml $(FUZZED); \
		status=$$?; $(BIN)/python tools/record_run.py fuzz .fuzz.xml; exit $$status

# Mutation testing of the core with mutmut (config: [tool.mutmut] in pyproject.toml), not
# in `make test` or CI; tests/mutation/README.md says what the last run found.
mutate: $(BIN)/.installed  ## mutation testing of the core with mutmut
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-mutate.txt
	rm -rf mutants
	TORCHCONTRACT_HYPOTHESIS_PROFILE=mutate $(BIN)/mutmut run --max-children 2 || true
	$(BIN)/python tools/mutation_summary.py

# Behavioural mutants of apis/ and testing (tools/api_mutants.py holds the list), each
# applied alone to a temporary copy of the source, with the tests that should catch it;
# not in `make test` or CI. Writes tests/mutation/apis.md.
mutate-apis: $(BIN)/.installed  ## behavioural mutants of apis/ and testing
	$(BIN)/python tools/api_mutants.py

clean:  ## remove .venv, the caches, mutants and site/
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis mutants site .fuzz.xml \
		.unit.xml .slow.xml
