#!/usr/bin/env bash
# Same-lease A/B of two blockdraft builds (see host_ab.py), ROUNDS alternating rounds:
#   A=<wheel or site dir> B=<wheel or site dir> OUT=/some/dir bash benchmarks/host_ab.sh
# A wheel is installed into its own site dir first. Prints one line per run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$root/bench-out}"
mkdir -p "$OUT"
site() {  # a wheel -> its own site dir; a dir as it is
  if [[ "$2" == *.whl ]]; then
    python3 -m pip install -q --no-deps --target "/tmp/ab-$1" "$2" >&2
    echo "/tmp/ab-$1"
  else
    echo "$2"
  fi
}
sa="$(site a "$A")"
sb="$(site b "$B")"
export PYTHONUNBUFFERED=1 OUT
for round in $(seq 1 "${ROUNDS:-2}"); do
  PYTHONPATH="$sa${EXTRA_PATH:+:$EXTRA_PATH}" TAG=a ROUND="$round" python3 "$root/benchmarks/host_ab.py"
  PYTHONPATH="$sb${EXTRA_PATH:+:$EXTRA_PATH}" TAG=b ROUND="$round" python3 "$root/benchmarks/host_ab.py"
done
