#!/usr/bin/env bash
# Data-parallel routing policies compared on one multi-tenant workload, in one run: for each
# policy a fresh server with two replicas, the same `strata bench serve` load, one JSON line
# per policy on stdout (the policy added), then the server is stopped.
#
#   benchmarks/dp_routing.sh NUM_GPU_BLOCKS [POLICY ...] [-- BENCH_FLAGS ...]
#
# Default policies: cache-aware round-robin least-loaded. Default load: 8 tenants x ~240-token
# system prompts, 96 requests, 4 in flight, 4 output tokens each (override after --).
set -euo pipefail

BLOCKS=${1:?usage: benchmarks/dp_routing.sh NUM_GPU_BLOCKS [POLICY ...] [-- BENCH_FLAGS ...]}
shift
POLICIES=()
while [[ $# -gt 0 && $1 != -- ]]; do POLICIES+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
BENCH_FLAGS=("$@")
[[ ${#POLICIES[@]} -gt 0 ]] || POLICIES=(cache-aware round-robin least-loaded)
[[ ${#BENCH_FLAGS[@]} -gt 0 ]] || BENCH_FLAGS=(
    --workload multi-tenant --tenants 8 --system-prompt-words 200
    --num-prompts 96 --max-tokens 4 --max-concurrency 4
)
PORT=${PORT:-8731}
URL=http://127.0.0.1:$PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

server=
stop_server() {
    if [[ -n $server ]]; then
        kill -TERM "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
        server=
    fi
}
trap stop_server EXIT

for policy in "${POLICIES[@]}"; do
    strata serve --port "$PORT" --data-parallel-size 2 --dp-routing "$policy" --num-gpu-blocks "$BLOCKS" \
        >"${LOG_DIR:-/tmp}/dp_routing_$policy.log" 2>&1 &
    server=$!
    until curl -sf "$URL/health" >/dev/null; do
        kill -0 "$server" 2>/dev/null || { echo "the $policy server died" >&2; exit 1; }
        sleep 1
    done
    strata bench serve --url "$URL" "${BENCH_FLAGS[@]}" --json \
        | python3 -c "import json, sys; r = json.load(sys.stdin); r['policy'] = '$policy'; print(json.dumps(r))"
    stop_server
done
