"""The installed wheel carries this project's `rendezvous` and `health` as `tpassrun.rendezvous` and
`tpassrun.health`, so a foreign top-level package called `rendezvous` or `health` can never shadow them,
and `tpassrun.rendezvous` / `tpassrun.health` never import the rest of tpassrun."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from faults import REPO

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), REPO]
    r = subprocess.run([*cmd[:4], "--no-build-isolation", *cmd[4:]], capture_output=True, text=True)
    if r.returncode != 0:
        r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (out / "build.log").write_text(r.stdout + r.stderr)
    (path,) = list(out.glob("tpassrun-*.whl"))
    return str(path)


def test_the_build_prints_no_deprecation_warning(wheel):
    """pyproject's ``license`` as a TOML table printed setuptools' deprecation box on every install; the SPDX
    string form (setuptools >= 77, which build-system requires) does not."""
    log = open(os.path.join(os.path.dirname(wheel), "build.log")).read()
    assert "SetuptoolsDeprecationWarning" not in log and "is deprecated" not in log, log[-3000:]
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in meta


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "tpassrun/rendezvous/__init__.py" in names
    assert "tpassrun/health/__init__.py" in names
    assert not any(n.startswith(("rendezvous/", "health/")) for n in names), "generic top-level names leaked"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "tpassrun = tpassrun.cli:main" in text and "tpassctl = tpassrun.ops.ctl:main" in text


def test_installed_wheel_imports_its_own_code_not_a_foreign_package(wheel, tmp_path):
    target, foreign = tmp_path / "site", tmp_path / "foreign"
    for name in ("rendezvous", "health"):
        (foreign / name).mkdir(parents=True)
        (foreign / name / "__init__.py").write_text("raise ImportError('foreign package imported')\n")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), wheel],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    probe = ("import sys, tpassrun.rendezvous as r, tpassrun.health as h; "
             "assert 'torch' not in sys.modules; "
             "assert not any(m.startswith('tpassrun.') and m.split('.')[1] not in ('rendezvous', 'health', 'schema') "
             "for m in sys.modules), sorted(sys.modules); print(r.__file__); print(h.__file__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(foreign), str(target)])}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    files = r.stdout.split()
    assert all(f.startswith(str(target)) for f in files), files
