#!/usr/bin/env bash
# Poisson traffic on the random qwen3-8b pair, speculation on beside speculation off
# (docs/BENCHMARKS.md, "Poisson traffic: speculation on and off"):
#   OUT=/some/dir bash benchmarks/serve_poisson.sh [bench_serve.py flags...]
# Writes the random pair of shape $SHAPE (qwen3-8b) to $PAIR (default /tmp/rp8; kept when it
# is already there), then runs benchmarks/bench_serve.py --poisson --serve, which starts
# `blockdraft serve` on the pair (--device $DEVICE (cuda), --max-active $MAX_ACTIVE (32),
# --max-seq-len $MAX_SEQ_LEN (4096)), warms it up, sends
# $RATE (4) requests/s for $DURATION (60) s, stops it, and does the same with --no-speculation.
# Prompts: 16..2048 tokens cut from the held-out corpus files; max_tokens 32..512. Writes
# poisson.json, poisson.md (the table) and the servers' logs under $OUT. Needs httpx and the
# `serve` extra.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" poisson
pair="${PAIR:-/tmp/rp8}"
if [ ! -f "$pair/drafter/config.json" ] || [ ! -f "$pair/target/config.json" ]; then
  "$py" benchmarks/random_pair.py "$pair" --shape "${SHAPE:-qwen3-8b}" --device "${DEVICE:-cuda}" >"$OUT/random_pair.log" 2>&1 || {
    tail -20 "$OUT/random_pair.log" >&2
    exit 1
  }
fi
"$py" benchmarks/bench_serve.py --poisson \
  --serve "--target $pair/target --drafter $pair/drafter --device ${DEVICE:-cuda} --max-active ${MAX_ACTIVE:-32} --max-seq-len ${MAX_SEQ_LEN:-4096}" \
  --tokenizer "$pair/target" --rate "${RATE:-4}" --duration "${DURATION:-60}" \
  --log-dir "$OUT" --json "$OUT/poisson.json" "$@" | tee "$OUT/poisson.md"
rc="${PIPESTATUS[0]}"
echo "results in $OUT"
exit "$rc"
