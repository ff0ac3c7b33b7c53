"""Benchmarks: every workload timed through torchcontract and through torch's contract.

Run them with ``make bench`` (``python -m benchmarks.report``), which writes the raw
pytest-benchmark JSON, ``results/RESULTS.md`` and ``results/apply_scaling.png``.
Files are named ``bench_*.py`` so that ``make test`` never collects them.
"""
