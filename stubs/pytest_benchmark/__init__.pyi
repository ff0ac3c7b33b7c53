# The parts of pytest-benchmark that the benchmarks use; the package ships no annotations.
