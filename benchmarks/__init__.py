"""Benchmark command lines: `python -m benchmarks.bench_step`, `python -m benchmarks.bench_train`."""
