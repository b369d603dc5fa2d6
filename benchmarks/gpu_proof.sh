#!/usr/bin/env bash
# The GPU proof on one GPU host without network (docs/gpu.md#the-gpu-proof):
#
#   benchmarks/gpu_proof.sh OUT_DIR [--wheels DIR] [--python PATH] [--phase install|tests|bench|all]
#
# Always first: the preflight (nvidia-smi, versions, C compiler, Python.h, one Triton kernel) and
# the install: every module strata imports that PATH lacks, each from its own wheel in DIR
# (default .gpu-wheels/ in the repository), then strata itself, all into a temporary folder put
# on PYTHONPATH, so the host's Python, torch and Triton are left as they are. A module without a
# wheel is named and the parts that need it are skipped. Then the phase: `tests` (the Triton
# kernel tests compiled, and the tests marked gpu) or `bench` (benchmarks/gpu_proof.py), each
# within one host command's 10 minutes; `all` runs both; `install` stops after the install.
# Everything it prints is also written into OUT_DIR (proof.log gathers every run). Exit status 1 if
# any step failed.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
USAGE="usage: benchmarks/gpu_proof.sh OUT_DIR [--wheels DIR] [--python PATH] [--phase install|tests|bench|all]"
# A phase's commands share this many seconds; then each gets SIGTERM, and SIGKILL KILL_AFTER_S
# later: more than ServerProcess.STOP_TIMEOUT_S (60 s), so gpu_proof.py can still stop strata
# serve. Preflight and install take about a minute more: each phase fits 10 minutes.
PHASE_BUDGET_S=420
KILL_AFTER_S=75
# The module each import needs and its wheel's distribution name (as wheel files spell it), for
# everything strata and its tests import. torch and triton must be the host's own.
MODULES="torch torch
triton triton
numpy numpy
transformers transformers
tokenizers tokenizers
safetensors safetensors
jinja2 jinja2
prometheus_client prometheus_client
tqdm tqdm
psutil psutil
httpx httpx
pytest pytest
peft peft
accelerate accelerate
yaml pyyaml
msgspec msgspec
zmq pyzmq
llguidance llguidance
gguf gguf
typing_extensions typing_extensions
annotated_types annotated_types
typing_inspection typing_inspection
pydantic_core pydantic_core
pydantic pydantic
opentelemetry opentelemetry_api
starlette starlette
fastapi fastapi
uvicorn uvicorn
ray ray"
SERVER_MODULES="fastapi uvicorn llguidance"  # benchmarks/gpu_proof.py skips bench serve without them

missing=()
failures=()
current_pid=

parse_args() {
    [[ $# -ge 1 && $1 != -* ]] || { echo "$USAGE" >&2; exit 2; }
    OUT_DIR=$(realpath -m "$1")
    shift
    WHEELS=$REPO/.gpu-wheels
    PYTHON=python3
    PHASE=all
    while [[ $# -gt 0 ]]; do
        case $1 in
            --wheels) WHEELS=$(realpath -m "${2:?$USAGE}") ;;
            --python) PYTHON=${2:?$USAGE} ;;
            --phase) PHASE=${2:?$USAGE} ;;
            *) echo "$USAGE" >&2; exit 2 ;;
        esac
        shift 2
    done
    [[ $PHASE =~ ^(install|tests|bench|all)$ ]] || { echo "$USAGE" >&2; exit 2; }
}

# Print to the terminal and append to OUT_DIR/proof.log.
say() {
    echo "$*" | tee -a "$OUT_DIR/proof.log"
}

has_module() {
    "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)" "$1" 2>/dev/null
}

is_missing() {
    [[ " ${missing[*]} " == *" $1 "* ]]
}

preflight() {
    say "== preflight ($OUT_DIR/preflight.txt)"
    {
        nvidia-smi || echo "nvidia-smi: FAILED (not found or no driver)"
        "$PYTHON" "$REPO/benchmarks/gpu_preflight.py"
    } 2>&1 | tee "$OUT_DIR/preflight.txt" | tee -a "$OUT_DIR/proof.log"
}

install_missing_modules() {
    say "== install (pip's output: $OUT_DIR/install.log)"
    local module dist wheels
    while read -r module dist; do
        has_module "$module" && continue
        wheels=("$WHEELS/$dist"-*.whl)
        if [[ ! -f ${wheels[0]} ]]; then
            say "missing: $module (no $dist wheel in $WHEELS)"
            missing+=("$module")
        elif "$PYTHON" -m pip install --no-index --no-deps --target "$SITE" "${wheels[0]}" >>"$OUT_DIR/install.log" 2>&1; then
            say "installed: $(basename "${wheels[0]}")"
        else
            say "missing: $module ($(basename "${wheels[0]}") did not install)"
            missing+=("$module")
        fi
    done <<<"$MODULES"
}

install_strata() {
    if "$PYTHON" -m pip install --no-deps --no-build-isolation --target "$SITE" "$REPO" >>"$OUT_DIR/install.log" 2>&1; then
        say "installed: strata"
    else
        # --no-build-isolation builds with the host's setuptools, which a bare Python lacks; the
        # repository folder is the package itself, so it imports as it is.
        say "strata did not build (see install.log): imported from the repository instead"
        ln -s "$REPO" "$SITE/strata"
    fi
}

report_skipped_parts() {
    local module
    is_missing ray && say "skipped: Ray (the proof never runs --executor ray)"
    # peft imports accelerate and yaml; the LoRA GPU test's reference merges adapters with it.
    if is_missing peft || is_missing accelerate || is_missing yaml; then
        say "skipped: the LoRA GPU test (needs peft, accelerate and yaml)"
    fi
    for module in $SERVER_MODULES; do
        is_missing "$module" && say "skipped: bench serve (needs $module)"
    done
    return 0
}

# Run a command under the phase's deadline, its output also in OUT_DIR/NAME.log; afterwards kill
# whatever of its process group is left. Returns the command's status (124: out of time).
run_limited() {
    local name=$1 left status
    shift
    left=$((phase_deadline - $(date +%s)))
    if ((left <= 0)); then
        say "$name: not run, the phase's $PHASE_BUDGET_S s are spent"
        return 124
    fi
    timeout -k "$KILL_AFTER_S" "$left" "$@" > >(tee "$OUT_DIR/$name.log") 2>&1 &
    current_pid=$!
    wait "$current_pid"
    status=$?
    # timeout leads a process group of its own: engine workers that outlived the command are in it.
    kill -KILL -- "-$current_pid" 2>/dev/null
    current_pid=
    say "$name: exit status $status"
    return "$status"
}

# The script itself was stopped (Ctrl-C, the host's time limit): stop the running command as its
# timeout would, and wait while it stops its own processes (at most KILL_AFTER_S).
stop_current() {
    if [[ -n $current_pid ]]; then
        kill -TERM -- "-$current_pid" 2>/dev/null
        wait "$current_pid"
    fi
    exit 143
}

run_pytest() {
    local name=$1
    shift
    run_limited "$name" "$PYTHON" -m pytest -o addopts="" -p no:xdist -p no:cacheprovider -rA --durations=25 \
        --junitxml="$OUT_DIR/$name.xml" "$@"
}

phase_tests() {
    say "== phase tests (logs and junit xml: $OUT_DIR/tests-*.log, tests-*.xml)"
    if is_missing pytest; then
        failures+=("tests (no pytest)")
        return
    fi
    local gpu_test_files
    mapfile -t gpu_test_files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
    run_pytest tests-triton tests/kernels/test_triton_*.py tests/worker/test_cuda_graphs.py || failures+=("Triton kernel tests")
    run_pytest tests-gpu -m gpu "${gpu_test_files[@]}" || failures+=("gpu tests")
}

phase_bench() {
    say "== phase bench ($OUT_DIR/results.md, results.json, bench.log, serve.log)"
    run_limited bench "$PYTHON" benchmarks/gpu_proof.py --out "$OUT_DIR" || failures+=("benchmarks")
}

summarize() {
    local failed=nothing
    if ((${#failures[@]})); then
        printf -v failed '%s, ' "${failures[@]}"
        failed=${failed%, }
    fi
    say "gpu proof finished in $(($(date +%s) - $1)) s; failed: $failed"
    ((${#failures[@]} == 0))
}

main() {
    parse_args "$@"
    mkdir -p "$OUT_DIR"
    cd "$REPO" || exit 1
    SITE=$(mktemp -d)
    trap 'rm -rf "$SITE"' EXIT
    trap stop_current TERM INT
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    unset TRITON_INTERPRET  # the Triton kernels are compiled for the GPU
    local started
    started=$(date +%s)
    say "gpu proof: phase $PHASE, python $PYTHON, wheels $WHEELS, results in $OUT_DIR"

    preflight || failures+=("preflight")
    install_missing_modules
    install_strata
    report_skipped_parts
    if is_missing torch || is_missing triton; then
        failures+=("no torch or Triton: nothing can run")
    elif [[ $PHASE != install ]]; then
        if [[ $PHASE == tests || $PHASE == all ]]; then
            phase_deadline=$(($(date +%s) + PHASE_BUDGET_S))
            phase_tests
        fi
        if [[ $PHASE == bench || $PHASE == all ]]; then
            phase_deadline=$(($(date +%s) + PHASE_BUDGET_S))
            phase_bench
        fi
    fi

    summarize "$started"
}

main "$@"
