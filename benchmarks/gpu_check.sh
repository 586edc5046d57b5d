#!/usr/bin/env bash
# The short GPU check (issue 11 item 6): one command of at most 9 minutes on an H200 (torch 2.11,
# Triton 3.6, Python 3.12, no internet). Everything lands in $OUT; what does not fit in this budget
# is in benchmarks/gpu_check_long.sh.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh            # default OUT: ./gpu-results
#   bash benchmarks/gpu_check.sh --dry-run                # print the steps and their budgets, run nothing
#
# Steps and their timeouts (seconds; they sum to 450, well under the 540 of one command):
#   build 170 | info 15 | gpu_tests 110 | bench (124M, 1B: stock fused, stock foreach, every
#   ampfused backend, copy roofline) 110 | host time + launches per step 45
# A step that fails or times out is recorded in $OUT/summary.txt and the script goes on.
# Without a GPU it builds, prints `info`, and stops where a GPU is needed (exit 0).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=$(mkdir -p "${OUT:-gpu-results}" && cd "${OUT:-gpu-results}" && pwd)
summary="$OUT/summary.txt"
: > "$summary"
elsewhere=$(mktemp -d)  # python -m puts the cwd first on sys.path: run the installed package from outside the checkout
BUDGET=0

ROOT=$(pwd)
step() {  # step NAME TIMEOUT_S DIR COMMAND...   (DIR: where the command runs)
    local name=$1 limit=$2 dir=$3; shift 3
    BUDGET=$((BUDGET + limit))
    if [ "$DRY" = 1 ]; then
        printf '%-10s %4ss  %s\n' "$name" "$limit" "$*" | tee -a "$summary"
        return 0
    fi
    local start=$SECONDS
    (cd "$dir" && timeout -k 5 "$limit" "$@") > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - start)) "$*" | tee -a "$summary"
    return $rc
}

if [ "$DRY" = 0 ]; then
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
fi

export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} AMPFUSED_BUILD_CUDA=${AMPFUSED_BUILD_CUDA:-auto}
step build 170 "$ROOT" pip install --no-build-isolation --no-deps .
step info 15 "$elsewhere" python -m ampfused info
[ "$DRY" = 0 ] && cat "$OUT/info.log"

if [ "$DRY" = 0 ] && ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA GPU here: stopping before the GPU tests and benchmarks" | tee -a "$summary"
    exit 0
fi

# gpu-marked tests only (no sync, CUDA graphs, launches per step, the CUDA/Triton kernels at size)
# (pytest, not python -m pytest: the installed ampfused with its _C, not the source tree)
step gpu_tests 110 "$ROOT" pytest tests -q -rs -m gpu -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"
step bench 110 "$elsewhere" python -m ampfused bench --device cuda --sweeps size --sizes 124M,1B --gate-steps 1 --out "$OUT/bench"
step host 45 "$elsewhere" python "$ROOT/benchmarks/gpu_host_check.py" --out "$OUT/host.csv"
echo "budget: ${BUDGET}s of timeouts" | tee -a "$summary"
[ "$DRY" = 0 ] && cat "$summary"
exit 0
