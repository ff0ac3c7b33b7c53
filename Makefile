# Every target works on a fresh clone: the first one run creates .venv and installs into it.
VENV   := .venv
BIN    := $(VENV)/bin
PYTHON ?= python3

.PHONY: test lint typecheck docs unit demo bench dist compat fuzz mutate mutate-apis clean

$(BIN)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

test: lint typecheck docs unit

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(BIN)/.installed
	$(BIN)/mypy
	$(BIN)/mypy --disallow-any-expr examples
	$(BIN)/basedpyright

# The documentation site, into site/: strict, so a broken link, a missing reference entry or
# a docstring that does not render fails the build. tests/test_docs.py runs the pages' code.
docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

unit: $(BIN)/.installed
	@$(BIN)/python -c 'import platform, torch; print(f"testing against torch {torch.__version__} (Python {platform.python_version()})")'
	$(BIN)/pytest -q

# `make demo DEMO_ARGS=--hsdp`: fully_shard as HSDP on 4 processes (2 replicas x 2 shards).
DEMO_ARGS ?=
demo: $(BIN)/.installed
	$(BIN)/python -m torchcontract.demo $(DEMO_ARGS)

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.report

dist: $(BIN)/.installed
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/twine check --strict dist/*

# The tests against several torch releases, each in its own cached venv outside the repo.
compat:
	bash tools/compat.sh

# Before a release, not in CI: the property and stateful tests with random seeds, ten
# times the examples and four times the stateful steps (profile "fuzz", tests/conftest.py).
FUZZED := tests/test_fqn_properties.py tests/test_store_stateful.py tests/test_bad_input.py \
	tests/test_store.py tests/test_state.py tests/test_contract.py tests/test_registry.py \
	tests/test_rules.py tests/test_describe.py tests/test_replicate_buckets.py
fuzz: $(BIN)/.installed
	TORCHCONTRACT_HYPOTHESIS_PROFILE=fuzz $(BIN)/pytest -q -p no:cacheprovider \
		--hypothesis-show-statistics $(FUZZED)

# Mutation testing of the core with mutmut (config: [tool.mutmut] in pyproject.toml), not
# in `make test` or CI; tests/mutation/README.md says what the last run found.
mutate: $(BIN)/.installed
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-mutate.txt
	rm -rf mutants
	TORCHCONTRACT_HYPOTHESIS_PROFILE=mutate $(BIN)/mutmut run --max-children 2 || true
	$(BIN)/python tools/mutation_summary.py

# Behavioural mutants of apis/ and testing (tools/api_mutants.py holds the list), each
# applied alone to a temporary copy of the source, with the tests that should catch it;
# not in `make test` or CI. Writes tests/mutation/apis.md.
mutate-apis: $(BIN)/.installed
	$(BIN)/python tools/api_mutants.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis mutants site
