"""What ``pip install`` puts into site-packages: one ``strata`` package, nothing generic."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).parents[2]
FOLDERS = ("engine_core", "worker", "connector", "kernels", "launch")


def build_wheel(tmp_path: Path) -> Path:
    """The project's wheel, built from a copy of the sources (so the tree gets no build/)."""
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("strata-*.whl")
    return wheel


def test_the_wheel_puts_only_strata_at_the_top_of_site_packages(tmp_path):
    names = zipfile.ZipFile(build_wheel(tmp_path)).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"strata"}
    for folder in FOLDERS:
        assert f"strata/{folder}/__init__.py" in names
    assert "strata/kernels/csrc/paged_attention.c" in names  # compiled on the user's machine
    assert "strata/launch/server/app.py" in names


def test_no_test_imports_the_folders_by_their_bare_names():
    bare = re.compile(rf"^\s*(from|import)\s+({'|'.join(FOLDERS)})\b", re.MULTILINE)
    offenders = [str(path) for path in (REPO / "tests").rglob("*.py") if bare.search(path.read_text())]
    assert offenders == []
