"""The docs site builds with ``mkdocs build --strict`` (mkdocs.yml turns a page missing from the nav, a
broken link or a broken anchor into a warning, so into a failure), and the README stays short."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_README_LINES = 250


def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "index.html").is_file()


def test_readme_is_short_and_names_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    num_lines = len(text.splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; at most {MAX_README_LINES}"
    for command in ("make serve", "make test"):
        assert command in text, f"README.md does not mention {command!r}"
