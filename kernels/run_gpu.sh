#!/usr/bin/env bash
# Every kernel benchmark and all GPU kernel tests (bf16/fp16), in one go, on a CUDA machine.
#   OUT=/some/dir bash kernels/run_gpu.sh    env.log, bench.log, bench.jsonl, gpu_tests.log
# Without OUT the files go to a fresh temporary directory (printed at the start and the end).
# Works without the compiled Rust core: the kernels package is imported behind a stub
# `blockdraft` package when `blockdraft._core` is missing.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
echo "writing under $OUT"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import blockdraft._core" 2>/dev/null; then
  shim="$(mktemp -d)"
  mkdir -p "$shim/blockdraft"
  # stub package: only `blockdraft.kernels` is needed, not the core
  printf '__path__ = [%s]\n' "'$root/python/blockdraft'" > "$shim/blockdraft/__init__.py"
  export PYTHONPATH="$shim:$PYTHONPATH"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.log"
rc=0
for b in ceilings kv_store attention causal selection dflash2 gemm; do
  echo "== bench_$b" | tee -a "$OUT/bench.log"
  (cd kernels && "$py" "bench_$b.py" --out "$OUT") 2>&1 | tee -a "$OUT/bench.log" || rc=1
done
"$py" -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_skinny_gemm_gpu.py \
  -p no:cacheprovider --durations=10 \
  2>&1 | tee "$OUT/gpu_tests.log" || rc=1
echo "wrote $OUT"
exit "$rc"
