"""ruff over the whole tree and mypy --strict over the typed core (scripts/lint.sh), as part of the suite."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_ruff_and_mypy_pass():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "lint.sh")], capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
