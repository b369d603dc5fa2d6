"""The wheel as users install it: every engine module inside, nothing else at the top of
site-packages, and, installed without the repository, a CLI that generates and serves."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
from server.server_helpers import running_server

REPO = Path(__file__).parents[2]
NOT_SHIPPED = ("tests", "benchmarks", "examples", "build", ".venv", ".git")
FOLDERS = ("engine_core", "worker", "connector", "kernels", "runtime", "launch")


def engine_modules() -> set[str]:
    """Every module of the engine in the checkout, as a path inside the wheel."""
    modules = set()
    for path in REPO.rglob("*.py"):
        relative = path.relative_to(REPO)
        if relative.parts[0] in NOT_SHIPPED or relative.parts[0].startswith(".") or relative == Path("setup.py"):
            continue
        modules.add(f"strata/{relative.as_posix()}")
    return modules


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the sources (so the tree gets no build/)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
    )
    [built] = tmp_path.glob("strata-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (not editable) and no network: the
    dependencies are this interpreter's, reached through a path file, so its editable
    ``strata`` (activated by its own path files, which a plain path entry does not run) stays
    out."""
    env = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    return env


def run_installed(env: Path, *command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``command`` run from outside the checkout, with only the environment's ``bin`` added."""
    environ = {**os.environ, "PATH": f"{env / 'bin'}:{os.environ['PATH']}"}
    environ.pop("PYTHONPATH", None)
    return subprocess.run(command, capture_output=True, text=True, cwd=env, env=environ, timeout=timeout)


def test_the_wheel_holds_every_engine_module_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name for name in names if name.endswith(".py")} == engine_modules()
    assert "strata/kernels/csrc/paged_attention.c" in names  # compiled on the user's machine


def test_the_wheel_puts_only_strata_at_the_top_of_site_packages(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"strata"}


def module_name(path_in_wheel: str) -> str:
    return path_in_wheel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_every_module_imports_from_the_installed_wheel(installed):
    script = (
        "import importlib, json, pkgutil, strata\n"
        "names = [m.name for m in pkgutil.walk_packages(strata.__path__, 'strata.')]\n"
        "for name in names:\n"
        "    if not name.endswith('.__main__'):  # runs the CLI\n"
        "        importlib.import_module(name)\n"
        "print(json.dumps({'location': strata.__file__, 'modules': names}))\n"
    )
    result = run_installed(installed, str(installed / "bin" / "python"), "-c", script)
    assert result.returncode == 0, result.stderr
    imported = json.loads(result.stdout)
    assert Path(imported["location"]).is_relative_to(installed)
    assert set(imported["modules"]) == {module_name(path) for path in engine_modules()} - {"strata"}


def test_installed_strata_generate_answers_on_the_default_model(installed):
    result = run_installed(
        installed, "strata", "generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout


def test_installed_strata_serve_answers_a_completion(installed, tmp_path):
    with running_server(tmp_path, "--max-model-len", "512", cli=(str(installed / "bin" / "strata"),)) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["text"]


def test_no_test_imports_the_folders_by_their_bare_names():
    bare = re.compile(rf"^\s*(from|import)\s+({'|'.join(FOLDERS)})\b", re.MULTILINE)
    offenders = [str(path) for path in (REPO / "tests").rglob("*.py") if bare.search(path.read_text())]
    assert offenders == []
