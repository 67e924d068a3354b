"""The repository's folders never stand in for installed packages.

transformers 5.25 imports the PyPI package ``kernels`` (its hub kernels) whenever that is installed, and it
installs it: a folder named ``kernels`` first on ``sys.path`` then breaks every import of a transformers model.
Two such folders could be: ``tests/kernels`` (pytest puts the first folder above a test package that is not
itself a package on ``sys.path``) and ``benchmarks/`` (``python benchmarks/x.py`` puts the script's folder
first, where ``kernels.py`` lies).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS, BENCHMARKS = ROOT / "tests", ROOT / "benchmarks"
BOOTSTRAP = re.compile(r'^if __package__ != "benchmarks": .*$', re.M)


def test_every_test_package_sits_in_the_tests_package():
    """So pytest names ``tests/kernels/test_x.py`` ``tests.kernels.test_x`` and puts the checkout's root on
    ``sys.path``, not ``tests/`` (where ``kernels`` would be a top-level package)."""
    orphans = [str(init.parent.relative_to(ROOT)) for init in TESTS.rglob("__init__.py")
               if any(not (parent / "__init__.py").is_file()
                      for parent in init.parents if parent == TESTS or TESTS in parent.parents)]
    assert orphans == []


def test_a_benchmark_run_as_a_file_takes_installed_packages_by_their_names():
    lines = {m.group(0) for script in BENCHMARKS.glob("*.py") if (m := BOOTSTRAP.search(script.read_text()))}
    assert len(lines) == 1, lines  # one line, as benchmarks/README.md says
    script = BENCHMARKS / "throughput.py"
    # As `python benchmarks/throughput.py` starts: the script's folder first on sys.path, then its first line.
    probe = "\n".join([
        "import importlib.util, sys",
        "from pathlib import Path",
        f"sys.path[0] = {str(BENCHMARKS)!r}",
        f"__file__, __package__ = {str(script)!r}, None",
        lines.pop(),
        "spec = importlib.util.find_spec('kernels')",
        "print(spec.origin if spec else 'not installed')",
    ])
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert not run.stdout.strip().startswith(str(BENCHMARKS)), run.stdout
