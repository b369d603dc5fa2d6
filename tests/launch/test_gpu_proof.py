"""The GPU proof's driver runs end to end on the CPU with tiny shapes (``--tiny``): every
benchmark, the engine runs with dummy weights and the report, on the code the GPU run takes."""

import importlib.util
import json
import math
from pathlib import Path

import psutil

DRIVER = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_proof.py"


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
    assert results["copy_bandwidth_bytes_per_s"] > 0 and results["matmul_peak_flop_per_s"] > 0
    assert [row["batch"] for row in results["decode_steps"]] == [1, 4]
    assert all(math.isfinite(row["ratio_to_bound"]) and row["eager_ms"] > 0 for row in results["decode_steps"])
    assert results["decode_attention"]["fraction_of_bandwidth"] > 0
    assert results["prefill_attention"]["fraction_of_matmul_peak"] > 0
    assert results["throughput"]["output_tokens"] == 4 * 4
    assert [(load["completed"], load["failed"]) for load in results["serve"]] == [(4, 0)]
    table = (tmp_path / "results.md").read_text()
    assert "| decode step tiny, batch 4 x 64 |" in table and "| bench serve, concurrency 2 |" in table
    assert running_children() - before == set()
