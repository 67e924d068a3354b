"""Benchmark scripts (each prints a table and writes benchmarks/results/<bench>-<device>.json, + .png) over one
helper module, benchmarks/common.py. See benchmarks/README.md."""
