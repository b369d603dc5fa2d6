"""The GPU proof on the CPU: its driver end to end with tiny shapes (``--tiny``): every benchmark,
the engine runs with dummy weights and the report, on the code the GPU run takes; a section that
raises is recorded and the next one runs; the shell script's preflight and install from a wheel
folder on a Python that lacks the modules and CUDA."""

import importlib.util
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import psutil
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
DRIVER = BENCHMARKS / "gpu_proof.py"


def load_driver():
    spec = importlib.util.spec_from_file_location("gpu_proof", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def running_children() -> set[psutil.Process]:
    return {child for child in psutil.Process().children(recursive=True) if child.status() != psutil.STATUS_ZOMBIE}


def test_tiny_proof_writes_every_figure_as_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = running_children()  # helpers earlier tests left for the process's life (multiprocessing's resource tracker)
    load_driver().main(["--tiny", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["sections"].values()) == {"ok"}
    assert results["copy_bandwidth_bytes_per_s"] > 0 and results["matmul_peak_flop_per_s"] > 0
    assert [row["batch"] for row in results["decode_steps"]] == [1, 4]
    assert all(math.isfinite(row["ratio_to_bound"]) and row["eager_ms"] > 0 for row in results["decode_steps"])
    assert [row["linears"] for row in results["quantized_decode"]] == ["unquantized", "fp8", "fp8-weight-only", "int8"]
    assert all(row["tokens_per_s"] > 0 for row in results["quantized_decode"])
    assert results["decode_attention"]["fraction_of_bandwidth"] > 0
    assert results["prefill_attention"]["fraction_of_matmul_peak"] > 0
    assert results["throughput"]["output_tokens"] == 4 * 4
    assert [(load["completed"], load["failed"]) for load in results["serve"]] == [(4, 0)]
    table = (tmp_path / "results.md").read_text()
    assert "| decode step tiny, batch 4 x 64 |" in table and "| bench serve, concurrency 2 |" in table
    assert "not completed" not in table
    assert running_children() - before == set()


def test_a_section_that_raises_is_recorded_and_the_next_one_runs_with_the_results_rewritten(tmp_path):
    driver = load_driver()
    report = driver.Report(tmp_path, {"device": "cpu", "plan": {"dtype": "float32"}, "torch": "x"})
    with report.section("copy bandwidth"):
        report.add("copy_bandwidth_bytes_per_s", 2e9)
    with report.section("matmul peak"):
        raise RuntimeError("no kernel image is available")
    assert json.loads((tmp_path / "results.json").read_text())["sections"] == {
        "copy bandwidth": "ok", "matmul peak": "error: RuntimeError: no kernel image is available"
    }
    with report.section("bench serve"):
        raise driver.Skipped("not installed: fastapi")
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sections"]["bench serve"] == "skipped: not installed: fastapi"
    table = (tmp_path / "results.md").read_text()
    assert "| device-to-device copy bandwidth | 2 GB/s |" in table
    assert "- matmul peak: error: RuntimeError: no kernel image is available" in table
    with pytest.raises(SystemExit), report.section("decode attention"):
        raise SystemExit(143)  # gpu_proof.py's SIGTERM handler: the run stops, recorded
    assert json.loads((tmp_path / "results.json").read_text())["sections"]["decode attention"] == "interrupted"


def fake_wheel(folder: Path, dist: str, module: str) -> None:
    """A wheel of ``dist`` 1.0 holding an empty module ``module``."""
    info = f"{dist}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{module}.py", "")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_the_script_reports_what_is_missing_installs_each_wheel_on_its_own_and_goes_on(tmp_path):
    # A Python with pip and nothing else: no torch, so no CUDA, and every module missing.
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(bare)], check=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "msgspec", "msgspec")
    (wheels / "pyzmq-1.0-py3-none-any.whl").write_text("not a zip")
    out = tmp_path / "out"
    script = [str(BENCHMARKS / "gpu_proof.sh"), str(out), "--wheels", str(wheels), "--python", str(bare / "bin" / "python"),
              "--phase", "install"]
    proof = subprocess.run(script, capture_output=True, text=True, timeout=120)
    log = (out / "proof.log").read_text()
    assert proof.returncode == 1, proof.stdout + proof.stderr
    assert "torch: FAILED: ModuleNotFoundError" in (out / "preflight.txt").read_text()
    assert "installed: msgspec-1.0-py3-none-any.whl" in log
    assert "missing: zmq (pyzmq-1.0-py3-none-any.whl did not install)" in log
    assert f"missing: ray (no ray wheel in {wheels})" in log
    assert "skipped: Ray" in log and "skipped: bench serve (needs fastapi)" in log
    assert "failed: preflight, no torch or Triton: nothing can run" in log
