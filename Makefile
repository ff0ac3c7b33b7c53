# Every target works on a fresh clone: the first one run creates .venv and installs into it.
VENV   := .venv
BIN    := $(VENV)/bin
PYTHON ?= python3

.PHONY: test lint typecheck unit demo bench dist compat clean

$(BIN)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

test: lint typecheck unit

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(BIN)/.installed
	$(BIN)/mypy
	$(BIN)/mypy --disallow-any-expr examples
	$(BIN)/basedpyright

unit: $(BIN)/.installed
	$(BIN)/pytest -q

demo: $(BIN)/.installed
	$(BIN)/python -m torchcontract.demo

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.report

dist: $(BIN)/.installed
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/twine check --strict dist/*

# The tests against several torch releases, each in its own cached venv outside the repo.
compat:
	bash tools/compat.sh

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
