#!/usr/bin/env bash
# K radixlm replicas behind smg (cache_aware) on this machine, for trying it out.
#
#   examples/cluster.sh [K] [-- extra radixlm serve flags]
#   K=2 PORT=8000 THREADS=1 SLOTS=32768 examples/cluster.sh      # the defaults
#
# Replica i listens on 127.0.0.1:$((PORT + i)) with --worker-id replica-i; smg on
# 127.0.0.1:$PORT (OpenAI API under /v1) and its Prometheus metrics on 127.0.0.1:$((PORT + 1000)).
# Logs go to $LOGS (default: a new temporary directory). Ctrl-C stops smg and every replica.
set -euo pipefail

K=${1:-${K:-2}}
[[ $# -gt 0 ]] && shift
[[ ${1:-} == "--" ]] && shift
PORT=${PORT:-8000}
THREADS=${THREADS:-1}
SLOTS=${SLOTS:-32768}
LOGS=${LOGS:-$(mktemp -d -t radixlm-cluster.XXXXXX)}
BIN=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin
PY=${PYTHON:-$BIN/python}
SMG=${SMG:-$BIN/smg}
command -v "$SMG" >/dev/null || SMG=smg
mkdir -p "$LOGS"

pids=()
stop() {
    trap - INT TERM EXIT
    echo "stopping ${#pids[@]} processes"
    for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    done
}
trap 'stop; exit 130' INT TERM
trap stop EXIT

wait_for() {  # URL: poll until it answers 200, at most 5 minutes (a replica loads its model)
    for _ in $(seq 1500); do
        curl -fs -o /dev/null "$1" && return 0
        sleep 0.2
    done
    echo "no answer from $1; see $LOGS" >&2
    return 1
}

urls=()
for i in $(seq 1 "$K"); do
    port=$((PORT + i))
    "$PY" -m radixlm serve --host 127.0.0.1 --port "$port" --worker-id "replica-$i" \
        --num-threads "$THREADS" --num-slots "$SLOTS" --log-level warning "$@" \
        >"$LOGS/replica-$i.log" 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do wait_for "$url/health"; done

"$SMG" launch --host 127.0.0.1 --port "$PORT" --worker-urls "${urls[@]}" \
    --policy cache_aware --worker-wedge-secs 30 \
    --prometheus-host 127.0.0.1 --prometheus-port $((PORT + 1000)) --log-level warn \
    >"$LOGS/smg.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$PORT/readiness" || wait_for "http://127.0.0.1:$PORT/health"

echo "smg (cache_aware) at http://127.0.0.1:$PORT in front of: ${urls[*]}"
echo "  curl http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "    -d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'"
echo "Ctrl-C stops everything (logs: $LOGS)"
wait -n "${pids[@]}" || true
echo "a process exited on its own; see $LOGS" >&2
