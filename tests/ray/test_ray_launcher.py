"""``strata launch ray``: Ray's ``ray start`` with serving defaults; a head it starts on loopback
serves ``strata generate --executor ray`` and stops, with all its processes, on SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from strata.engine_core.ipc import free_tcp_port
from strata.runtime.executors.ray_launcher import LaunchError, RayNodeOptions, start_command, start_environment

from conftest import descendants, live, wait_until_none_left

HEAD_START_TIMEOUT_S = 90


def strata(*args: str) -> list[str]:
    return [sys.executable, "-m", "strata.launch.cli", *args]


def without_auth_mode() -> dict[str, str]:
    """This environment (with its throw-away RAY_AUTH_TOKEN) minus any RAY_AUTH_MODE, so that
    what the launcher and the executor decide about authentication is what gets tested."""
    return {name: value for name, value in os.environ.items() if name != "RAY_AUTH_MODE"}


def wait_for_line(process: subprocess.Popen, marker: str, timeout_s: float) -> list[str]:
    """The output lines up to the one containing ``marker``; fails if the output ends or the
    time runs out first. The output keeps being drained, so the process never blocks on it."""
    lines: list[str] = []
    seen, ended = threading.Event(), threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if marker in line:
                seen.set()
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not seen.is_set() and not ended.is_set() and time.monotonic() < deadline:
        seen.wait(0.2)
    assert seen.is_set(), f"no {marker!r} in the output:\n{''.join(lines)}"
    return lines


def test_generate_runs_on_a_head_started_by_launch_ray_and_sigterm_stops_it(ray_temp_dir):
    port = free_tcp_port()
    head = subprocess.Popen(
        strata("launch", "ray", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
               "--num-cpus", "2", "--temp-dir", ray_temp_dir, "--block"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=without_auth_mode(),
    )
    try:
        output = wait_for_line(head, "Ray runtime started", HEAD_START_TIMEOUT_S)
        assert any("token authentication is on" in line for line in output)
        started_by_head = descendants(psutil.Process(head.pid))
        result = subprocess.run(
            strata("generate", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "--tensor-parallel-size", "2",
                   "--dtype", "float32", "--temperature", "0", "--max-tokens", "8", "--json", "--no-progress",
                   "--prompt", "The capital of France is"),
            capture_output=True, text=True, env=without_auth_mode(), timeout=300,
        )
        assert result.returncode == 0, result.stderr
        [record] = [json.loads(line) for line in result.stdout.splitlines()]  # Ray's logs stay off stdout
        assert record["finish_reason"] == "length" and len(record["token_ids"]) == 8
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)
    assert head.returncode == 0
    wait_until_none_left(lambda: live(started_by_head))


def test_start_command_has_the_serving_defaults_and_passes_extra_flags_on():
    options = RayNodeOptions(head=True, node_ip_address="127.0.0.1", ray_start_args=["--object-manager-port", "8076"])
    command = start_command(options)
    assert command[1:] == [
        "start", "--disable-usage-stats", "--include-dashboard=false", "--head", "--port", "6379",
        "--node-ip-address", "127.0.0.1", "--object-manager-port", "8076",
    ]
    assert "--include-dashboard=true" in start_command(RayNodeOptions(head=True, dashboard=True))


def test_a_joining_node_passes_no_dashboard_flag_which_ray_start_refuses_there():
    assert not any("dashboard" in arg for arg in start_command(RayNodeOptions(address="10.0.0.1:6379")))
    with pytest.raises(ValueError, match="--dashboard is the head's"):
        RayNodeOptions(address="10.0.0.1:6379", dashboard=True)


def test_a_loopback_node_address_keeps_ray_on_loopback():
    env = start_environment(RayNodeOptions(head=True, node_ip_address="127.0.0.1", disable_auth=True), {})
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"


def no_token_environment(home) -> dict[str, str]:
    """An environment with no Ray token: none in the variables, an empty home directory."""
    return {"PATH": os.environ["PATH"], "HOME": str(home)}


def test_a_head_without_a_token_generates_one_and_turns_authentication_on(tmp_path):
    env = start_environment(RayNodeOptions(head=True), no_token_environment(tmp_path))
    assert env["RAY_AUTH_MODE"] == "token"
    assert (tmp_path / ".ray" / "auth_token").read_text().strip()


def test_a_joining_node_without_a_token_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(LaunchError, match=r"no token: copy the head's ~/\.ray/auth_token"):
        start_environment(RayNodeOptions(address="10.0.0.1:6379"), no_token_environment(tmp_path))


def test_disable_auth_turns_authentication_off_without_needing_a_token(tmp_path):
    env = start_environment(RayNodeOptions(address="10.0.0.1:6379", disable_auth=True), no_token_environment(tmp_path))
    assert env["RAY_AUTH_MODE"] == "disabled"
    assert not (tmp_path / ".ray").exists()
