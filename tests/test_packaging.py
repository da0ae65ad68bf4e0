"""``python -m build`` makes an sdist with every C source and header, and from it a wheel with the
native extensions compiled, the command's entry point and ``py.typed``; the extension imports
from the unpacked wheel. (.ci/run installs that wheel into the vLLM venv for the engine tests.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
EXTENSIONS = ("tiersync/transfer/_kernel", "tiersync/net/_wire", "tiersync/net/_local")
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")  # e.g. .cpython-311-x86_64-linux-gnu.so


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    if importlib.util.find_spec("build") is None:
        pytest.skip("needs the 'build' package (the dev extra: pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: this venv's setuptools (the dev extra), no download; the wheel is built from the
    # sdist, as pip builds one from PyPI; TIERSYNC_REQUIRE_NATIVE=1: a C compile error fails the build
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), ROOT],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(out),
        env={**os.environ, "TIERSYNC_REQUIRE_NATIVE": "1"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    names = sorted(os.listdir(out))
    assert len(names) == 2, names
    return {name.rsplit(".", 1)[-1] if name.endswith(".whl") else "sdist": out / name for name in names}


@pytest.mark.timeout(300)
def test_wheel_holds_the_compiled_extensions_and_the_entry_point(dist, tmp_path):
    with zipfile.ZipFile(dist["whl"]) as whl:
        names = set(whl.namelist())
        entry_points = whl.read("tiersync-0.1.0.dist-info/entry_points.txt").decode()
        whl.extractall(tmp_path)
    assert {f"{ext}{SUFFIX}" for ext in EXTENSIONS} <= names
    assert {
        "tiersync/__main__.py",
        "tiersync/py.typed",
        "tiersync/settings.py",
        "tiersync/demo/tiny_llama.json",
        "tiersync/integrations/vllm/config.py",
    } <= names
    assert "tiersync = tiersync.cli:main" in entry_points
    code = (
        "import sys, tiersync.transfer._kernel as k, tiersync.net._wire, tiersync.net._local; "
        "from tiersync.cli import main; print(k.__file__); sys.exit(main(['--version']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # before this checkout's src/
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(tmp_path / f"tiersync/transfer/_kernel{SUFFIX}"), "tiersync 0.1.0"]


@pytest.mark.timeout(300)
def test_sdist_holds_every_c_source_and_header(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {
        "setup.py",
        "pyproject.toml",
        "README.md",
        "src/tiersync/transfer/tsum64.h",
        "src/tiersync/transfer/_kernel.c",
        "src/tiersync/net/_wire.c",
        "src/tiersync/net/_local.c",
    } <= names
