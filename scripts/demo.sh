#!/usr/bin/env bash
# Start `dyn serve` (built-in SmolLM2-135M on CPU, no external services), ask one chat question, stop.
set -euo pipefail
PORT="${PORT:-8000}"
log=$(mktemp)
dyn serve --port "$PORT" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
    grep -q "dyn serve ready" "$log" && break
    kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
done
grep "dyn serve ready" "$log"
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What color is the sky on a clear day?"}], "max_tokens": 48, "temperature": 0}'
echo
