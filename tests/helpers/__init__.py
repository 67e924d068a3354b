"""Code the tests run that is not a test itself (benchmarks/ may use it; tests never import benchmarks/)."""
