#!/usr/bin/env bash
# One replica behind Ray Serve beside `blockdraft serve` on its own (docs/BENCHMARKS.md,
# "Serving", "Through Ray Serve"):
#   OUT=/some/dir bash benchmarks/serve_ray.sh [serve flags...]
# Starts `blockdraft serve [serve flags...]` on 127.0.0.1:$PORT (default 8011), waits for
# /health (after its warm-up), sends one short request, then runs benchmarks/bench_serve.py once
# per concurrency in $CLIENTS (default "1 8 32"), each client sending $REQUESTS (default 4)
# streamed requests of $MAX_TOKENS (default 128) tokens, and stops it with SIGTERM; then does the
# same with `blockdraft serve --replicas 1 [serve flags...]` (a local Ray cluster, the replica
# behind Ray Serve's HTTP proxy on the same port). Without --device the flags get
# --device $DEVICE (default cuda); without --target/--drafter the built-in pair is served.
# Writes direct.log, ray.log, bench_direct_c<N>.json, bench_ray_c<N>.json and serve_ray.md (one
# row per concurrency: TTFT p50 / p99 and output tokens/s of both) under $OUT. Runs the CLI as
# `$PYTHON -m blockdraft.cli` (no console scripts needed, Ray's included). Needs httpx, the
# `serve` extra and the `ray` extra.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" serve-ray
port="${PORT:-8011}"
url="http://127.0.0.1:$port"
flags=("$@")
case " $* " in
  *" --device "*|*" --device="*) ;;
  *) flags+=(--device "${DEVICE:-cuda}") ;;
esac
export RAY_USAGE_STATS_ENABLED=0  # no usage report (the GPU machine has no network)
server=""

stop_server() {
  if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
    kill -TERM "$server"
    for _ in $(seq 1 120); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL "$server" 2>/dev/null
    wait "$server" 2>/dev/null
  fi
  server=""
}
trap stop_server EXIT

# run NAME [extra serve flags...]: start the server, load it at each concurrency, stop it.
run() {
  local name="$1"
  shift
  "$py" -m blockdraft.cli serve --port "$port" --max-active "${MAX_ACTIVE:-32}" "${flags[@]}" "$@" \
    >"$OUT/$name.log" 2>&1 &
  server=$!
  for _ in $(seq 1 "${START_TIMEOUT:-600}"); do
    if "$py" -c "import httpx,sys; sys.exit(httpx.get('$url/health', timeout=2).status_code != 200)" 2>/dev/null; then
      break
    fi
    if ! kill -0 "$server" 2>/dev/null; then
      echo "$name: the server exited before it was healthy:" >&2
      tail -20 "$OUT/$name.log" >&2
      return 1
    fi
    sleep 1
  done
  local rc=0
  "$py" benchmarks/bench_serve.py "$url" --clients 1 --requests 1 --max-tokens 16 >/dev/null || rc=1
  for c in ${CLIENTS:-1 8 32}; do
    echo "$name: concurrency $c" >&2
    "$py" benchmarks/bench_serve.py "$url" --clients "$c" --requests "${REQUESTS:-4}" \
      --max-tokens "${MAX_TOKENS:-128}" --json "$OUT/bench_${name}_c$c.json" >"$OUT/bench_${name}_c$c.md" || rc=1
  done
  stop_server
  return "$rc"
}

rc=0
run direct || rc=1
run ray --replicas 1 || rc=1
CLIENTS="${CLIENTS:-1 8 32}" "$py" - "$OUT" <<'EOF' | tee "$OUT/serve_ray.md"
import json, os, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| clients | direct TTFT p50 / p99 ms | Ray TTFT p50 / p99 ms | direct tok/s | Ray tok/s |")
print("| --- | --- | --- | --- | --- |")
for c in os.environ["CLIENTS"].split():
    cells = []
    for name in ("direct", "ray"):
        path = out / f"bench_{name}_c{c}.json"
        cells.append(json.loads(path.read_text())["summary"] if path.exists() else None)
    ttft = ["—" if s is None else f"{s['ttft_ms_p50']:.1f} / {s['ttft_ms_p99']:.1f}" for s in cells]
    tps = ["—" if s is None else f"{s['tokens_per_s']:.1f}" for s in cells]
    print(f"| {c} | {ttft[0]} | {ttft[1]} | {tps[0]} | {tps[1]} |")
EOF
echo "results in $OUT"
exit "$rc"
