#!/usr/bin/env bash
# Every gpu-marked test (bf16/fp16 kernels, bf16 parity with dflash, CUDA graphs, Triton soak)
# on a CUDA machine, plus the proof that the abi3 wheel imports there. Logs under $OUT.
#   maturin build --release          # on the build machine: target/wheels/*.whl
#   python3 -m pip install -q --no-deps --target /tmp/site target/wheels/*.whl .whl/dflash-*.whl
#   export PYTHONPATH=/tmp/site; OUT=/some/dir bash tests/gpu/run_all.sh
# A release wheel has no test hooks: the Triton soak with injected faults skips (saying so) and
# the one without faults runs. A wheel built with `--features test-hooks` runs both.
# Without OUT the logs go to a fresh temporary directory (printed at the start).
# BLOCKDRAFT_SOAK_CYCLES sets the GPU soak's length (default here 5000).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
echo "writing under $OUT"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export BLOCKDRAFT_SOAK_CYCLES="${BLOCKDRAFT_SOAK_CYCLES:-5000}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c "import sys, platform, torch, triton, transformers; print(sys.version.split()[0], platform.libc_ver(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  # The wheel's extension, not a source tree's: prints where blockdraft._core was loaded from.
  "$py" -c "import blockdraft, blockdraft._core as c; p = blockdraft.BlockPool(8, 16); print('import ok', blockdraft.__version__, c.__file__, p.alloc(3), p.num_free)"
} 2>&1 | tee "$OUT/env.log"
"$py" -m pytest -q -m gpu tests/gpu tests/reliability/test_soak.py -p no:cacheprovider -s --durations=15 \
  2>&1 | tee "$OUT/gpu_tests.log"
