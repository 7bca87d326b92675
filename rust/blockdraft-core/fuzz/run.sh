#!/usr/bin/env bash
# Fuzz the core's operation-sequence interpreter for a fixed time, then record the figures.
#
#   bash rust/blockdraft-core/fuzz/run.sh [SECONDS]      (default 300)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a C++ compiler; on a stable toolchain
# RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its -Z flags. New interesting inputs land in
# corpus/ops/, which is then minimized (`cargo fuzz cmin`; commit it); the run's figures go to
# last_run.json, which the Python scorecard prints. A crash stops the run and leaves artifacts/ops/crash-*.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
seconds="${1:-300}"
cd "$here/.."
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# No AddressSanitizer: the core is safe Rust, and ASan would cost most of the executions.
RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir "$here" -s none ops "$here/corpus/ops" -- \
  -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 2>&1 | tee "$log" | grep -E "^(#[0-9]+ +(DONE|INITED)|Done|stat::|==|thread)" || true
if grep -q "panicked\|deadly signal\|SUMMARY" "$log"; then
  echo "fuzz: a crash was found (see $here/artifacts/ops/)" >&2
  exit 1
fi
# Keep the committed corpus small: drop inputs that add no coverage.
RUSTC_BOOTSTRAP=1 cargo fuzz cmin --fuzz-dir "$here" -s none ops "$here/corpus/ops" >/dev/null 2>&1
execs="$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)"
corpus="$(find "$here/corpus/ops" -type f | wc -l)"
cat > "$here/last_run.json" <<JSON
{
  "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
  "command": "bash rust/blockdraft-core/fuzz/run.sh $seconds",
  "seconds": $seconds,
  "executions": ${execs:-0},
  "corpus_files_after_cmin": $corpus,
  "crashes": 0
}
JSON
cat "$here/last_run.json"
