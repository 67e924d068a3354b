"""Soak test: many concurrent clients, good and bad, against one server for a bounded time; checks it survives.

The harness is tests/helpers/soak.py (tests/server/test_soak.py runs it for 60 seconds; its docstring says
what is sent and checked). This entry point runs it with the report in
benchmarks/results/soak-<device>.json unless ``--output`` says otherwise.

    .venv/bin/python benchmarks/soak.py                       # 10 minutes, 16 clients, tiny random Llama
    .venv/bin/python benchmarks/soak.py --seconds 60 --clients 8 --exclude bounds
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import result_path  # noqa: E402
from tests.helpers import soak  # noqa: E402


def main(argv=None) -> int:
    return soak.main(argv, default_output=result_path("soak"))


if __name__ == "__main__":
    sys.exit(main())
