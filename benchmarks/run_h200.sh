#!/usr/bin/env bash
# The whole benchmark matrix on one CUDA GPU, in one go (qwen3-8b random pair, bf16):
#   OUT=/some/dir bash benchmarks/run_h200.sh
# Writes env.log, gpu_tests.log (graph == plain drafts), bench.json, bench.md, bench.log and
# the two PNG charts under $OUT (default: a new directory under ${TMPDIR:-/tmp}/blockdraft-bench,
# outside the checkout). Needs blockdraft importable (wheel or `maturin develop`) and
# dflash==0.1.0 for the reference columns. REPS / LOOP_REPS / E2E_STEPS / E2E_REPEATS / SHAPE
# override sizes.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" run
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  "$py" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.log"
rc=0
"$py" -m pytest -q -m gpu tests/gpu/test_graphs_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
"$py" -m blockdraft.cli bench --shape "${SHAPE:-qwen3-8b}" --reps "${REPS:-15}" --warmup 2 \
  --loop-reps "${LOOP_REPS:-3}" --e2e-steps "${E2E_STEPS:-16}" --e2e-repeats "${E2E_REPEATS:-3}" --out "$OUT" --plot \
  2>&1 | tee "$OUT/bench.log" || rc=1
echo "results in $OUT"
exit "$rc"
