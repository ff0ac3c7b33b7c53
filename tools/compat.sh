#!/usr/bin/env bash
# make compat: the test suite (not the benchmarks) against each torch release in $COMPAT_TORCH.
#
# Each release gets its own virtual environment under $COMPAT_DIR (outside the repository),
# keyed by version and made once: torch at that version, the development requirements but
# torch, and this checkout installed editable. Prints one line per release and exits
# non-zero if any release failed. Not part of `make test`: most releases are
# several-GB downloads.
#
# Each release's result is written to docs/generated/compat/torch-<version>.md (a table row)
# and torch-<version>-skips.md (why tests were skipped, with counts), by
# tools/compat_results.py: docs/supported-versions.md includes both, so its figures are the
# ones this script measured.
set -uo pipefail
cd "$(dirname "$0")/.."
# The floor and the newest release; the development pin (2.13.0) is what `make test` runs.
versions=${COMPAT_TORCH:-"2.6.0 2.14.1"}
root=${COMPAT_DIR:-"$HOME/.cache/torchcontract/compat"}
python=${PYTHON:-python3}
mkdir -p "$root"
requirements=$(grep -v '^torch==' requirements-dev.txt)
stamp=$(cat requirements-dev.txt requirements-torchft.txt | grep -v '^torch==' | sha256sum \
  | cut -c1-12)
status=0
summary=()
rows=()
for version in $versions; do
  venv="$root/torch-$version"
  if [ ! -f "$venv/.installed-$stamp" ]; then
    echo "== torch $version: installing into $venv"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || { status=1; continue; }
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$version" \
        $(printf '%s\n' "$requirements" | grep -v '^#' | tr '\n' ' '); then
      summary+=("torch $version: install failed"); status=1; continue
    fi
    # torchft where it installs beside this torch (it asks torch>=2.7); elsewhere its tests
    # skip, saying so. The constraint keeps pip from replacing torch to make room for it.
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check \
        -c <(echo "torch==$version") -r requirements-torchft.txt; then
      echo "== torch $version: torchft does not install beside it; its tests will skip"
    fi
    # torchao where it imports beside this torch (0.18 needs a torch newer than 2.6): elsewhere
    # it is removed, its tests skip, and transformers, which imports it when present, works.
    if ! "$venv/bin/python" -c "import torchao" >/dev/null 2>&1; then
      echo "== torch $version: torchao does not import beside it; removed, its tests will skip"
      "$venv/bin/pip" uninstall --quiet --yes torchao
    fi
    rm -f "$venv"/.installed-*
    touch "$venv/.installed-$stamp"
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e . >/dev/null
  log="$root/torch-$version.log"
  echo "== torch $version: running the tests (log: $log)"
  CI=true "$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadfile tests \
    >"$log" 2>&1
  code=$?
  result=$(grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=' \
    | sed -e 's/^ *//' -e 's/ *$//')
  summary+=("torch $version ($(date -u +%Y-%m-%d)): ${result:-no result, exit $code}")
  [ "$code" -eq 0 ] || status=1
  "$python" tools/compat_results.py "$version" "$log" "$code" docs/generated/compat
done
printf '\n'
printf '%s\n' "${summary[@]}"
exit "$status"
