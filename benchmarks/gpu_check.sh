#!/usr/bin/env bash
# One-shot GPU check (DESIGN §6, issues 3-5): build the extension, run the whole test suite on the
# GPU (sync-debug and CUDA-graph tests included), run the benchmarks, and leave everything in $OUT.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh        # default OUT: ./gpu-results
#
# On a machine without a GPU it builds, prints `info`, and stops where a GPU is needed (exit 0), so
# the script itself is checked on CPU machines. Every step logs to $OUT/<step>.log; a failing step
# is recorded in $OUT/summary.txt and the script goes on, so one run gives the full picture.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${OUT:-gpu-results}" && cd "${OUT:-gpu-results}" && pwd)
summary="$OUT/summary.txt"
: > "$summary"
# python -m puts the cwd first on sys.path: run installed-package commands from outside the checkout
elsewhere=$(mktemp -d)

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - start)) "$*" | tee -a "$summary"
    return $rc
}

{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    python - <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", "SMs", p.multi_processor_count)
PY
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} AMPFUSED_BUILD_CUDA=${AMPFUSED_BUILD_CUDA:-auto}
step build 900 pip install --no-build-isolation --no-deps -v .
(cd "$elsewhere" && step info 120 python -m ampfused info)
cat "$OUT/info.log"

if ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA GPU here: stopping before the GPU tests and benchmarks" | tee -a "$summary"
    exit 0
fi

# The whole suite runs on the GPU (conftest picks cuda as the test device, every backend that serves it).
# GPU-only tests first (no sync, CUDA graphs, CUDA kernels vs reference), then the whole suite.
step gpu_tests 600 pytest tests -q -rs -m gpu --junitxml="$OUT/gpu_tests.xml" -p no:cacheprovider
step tests 900 pytest tests -q -rs --junitxml="$OUT/tests.xml" -p no:cacheprovider
# The step benchmark (every backend vs stock fused/foreach, correctness gate first), then training.
(cd "$elsewhere" && step bench 900 python -m ampfused bench --device cuda --sweeps configs,size --sizes 1M,100M,1B --out "$OUT/bench")
(cd "$elsewhere" && step train 600 python -m ampfused bench train --device cuda --out "$OUT/train")
cat "$summary"
