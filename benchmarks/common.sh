# Sourced by the benchmark scripts, with the run's name:
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh" NAME
# Runs from the checkout's root, makes $OUT (default: a new directory under
# ${TMPDIR:-/tmp}/blockdraft-bench, outside the checkout, named after NAME and the time) and sets
# $py to the interpreter ($PYTHON, else python3).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-${TMPDIR:-/tmp}/blockdraft-bench/$1-$(date +%Y%m%d-%H%M%S)-$$}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
