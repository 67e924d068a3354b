"""Code the tests run that is not a test itself (benchmarks/ may use it). Tests import benchmarks/ only to test a
script's own logic (tests/unit/test_ab_compare.py, test_kernels_benchmark.py, test_profile_step.py)."""
