#!/usr/bin/env bash
# One server, load at several concurrencies (the serving table of docs/BENCHMARKS.md):
#   OUT=/some/dir bash benchmarks/serve_matrix.sh [serve flags...]
# Starts `blockdraft serve [serve flags...]` on 127.0.0.1:$PORT (default 8011), waits for
# /health, then runs benchmarks/bench_serve.py once per concurrency in $CLIENTS (default
# "1 8 32"), each client sending $REQUESTS (default 4) streamed requests of $MAX_TOKENS
# (default 128) tokens, and stops the server with SIGINT. Writes serve.log, one
# bench_c<N>.json per concurrency and serve.md (the rows) under $OUT (default: a new
# directory under ${TMPDIR:-/tmp}/blockdraft-bench). Without serve flags it serves the
# built-in pair. Needs httpx and the `serve` extra.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" serve
port="${PORT:-8011}"
url="http://127.0.0.1:$port"
"$py" -m blockdraft.cli serve --port "$port" --max-active "${MAX_ACTIVE:-32}" "$@" >"$OUT/serve.log" 2>&1 &
server=$!
trap 'kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null' EXIT
for _ in $(seq 1 "${START_TIMEOUT:-600}"); do
  if "$py" -c "import httpx,sys; sys.exit(httpx.get('$url/health', timeout=2).status_code != 200)" 2>/dev/null; then
    break
  fi
  if ! kill -0 "$server" 2>/dev/null; then
    echo "the server exited before it was healthy:" >&2
    tail -20 "$OUT/serve.log" >&2
    exit 1
  fi
  sleep 1
done
rc=0
# One short warm-up request: kernel compiles and graph captures stay out of the timed rows.
"$py" benchmarks/bench_serve.py "$url" --clients 1 --requests 1 --max-tokens 16 >/dev/null || rc=1
for c in ${CLIENTS:-1 8 32}; do
  echo "concurrency $c" >&2
  "$py" benchmarks/bench_serve.py "$url" --clients "$c" --requests "${REQUESTS:-4}" \
    --max-tokens "${MAX_TOKENS:-128}" --json "$OUT/bench_c$c.json" | tee -a "$OUT/serve.md" || rc=1
done
echo "results in $OUT"
exit "$rc"
