#!/usr/bin/env bash
# The first-contact GPU check: ONE command of at most 7.5 minutes on an H200 (torch
# 2.11, Triton 3.6, no internet), so that a rerun fits in the same 15-minute device lease.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh            # default OUT: ./gpu-results
#   bash benchmarks/gpu_check.sh --dry-run                # print the stages and their budgets, run nothing
#
# The device hands back at most 8 files, so $OUT holds exactly
# two: summary.txt (one line per stage: exit code, seconds) and results.tar.gz (every log, CSV,
# markdown and plot). Both are rewritten (atomically: write, then mv) after EVERY stage, so a stage
# that hangs, or a lease that ends, keeps what the earlier stages produced.
#
# Stages, by value, each under its own timeout (seconds; they sum to 450):
#   setup 15 (setuptools >= 77 for the pyproject license field, versions, nvidia-smi)
#   build 100 (AMPFUSED_BUILD_CUDA=1: a CPU-only build fails loudly; build log kept) | info 10
#   check 100 (python -m ampfused check: every backend against the reference on this device, before
#     the tests, so that no later stage's timeout can cost it; it compiles the Triton kernels that
#     gpu_tests, bench and host then find in Triton's cache)
#   gpu_tests 80 (pytest -m gpu: no sync, CUDA graphs incl. 30 groups + bf16 lr and compact state,
#     launches, kernels at size)
#   compact 35 (the CUDA kernel's compact modes against the specification and the reference:
#     the cuda cases of tests/compact (-k "cuda and not emulated"), its own stage so that a timeout of
#     either keeps the other)
#   bench 50 (fp32 and bf16 steps at 124M and 1B vs stock fused + clip_grad_norm_, copy roofline)
#   memory 45 (the memory sweep: every compact mode's ms/step and kept B/param, measured, at the GPU
#     plan's 124M GPT-2-like shapes and 1B, against stock fused and ampfused fp32 masters)
#   host 15 (host time and launches per step at 148, 291 and 2000 tensors)
# Triton compiles on the GPU machine one specialization at a time, in the stage that first launches
# it; Triton's cache serves the later stages. Compile time per specialization, measured with the sm90
# driver (tests/contract/sm90_compile.py: Triton 3.6's compile, ptxas included, in CPU seconds, which
# is what an idle core takes; one core of a 2-core AMD EPYC VM; every row in docs/results/sm90-kernels.md):
#   update kernel 1.5-2.0 s plain, 4.5-4.7 split16 or bf16 moments, 15-17 split8 + bf16 moments,
#   8-9 int8 + SR, 21-25 split16 + int8, 33-41 split16 + int4, 45-53 split8 + int8, 68-78 split8 +
#   int4, 82-92 every encoding at once; stats 0.4-0.5 s, scaler and accumulate 0.1 s.
# check compiles 12 specializations, counted by running its cases under the sm90 driver with every
#   launch declined: 7 update variants (plain with and without WRITE_GRAD, split16 + WRITE_GRAD,
#   split8 + bf16 moments, bf16 moments + SR, int8 moments, split16 + int4), 4 stats, 1 scaler:
#   about 70 s of compiling (int8 alone taken as int8 + SR), on top of the 30 s the stage had for its run.
# gpu_tests adds 4 that check does not compile (split8 alone and bf16 moments alone from the
#   graph-replay cases; the stats and update kernels specialized for a single tensor from the
#   scaler-collapse test; counted from the Triton-backend tests' optimizer configurations the same
#   way): about 22 s (split8 alone taken as split8 + bf16 moments) on top of its 60 s.
# The 90 s this takes from build (150 -> 100), bench (65 -> 50), memory (65 -> 45) and host (20 -> 15)
# are not measured on a GPU: the first run's summary.txt says whether they hold. bench and memory
# compile the specializations of their own modes that check did not (split8 + int8 alone is ~50 s).
# Without a GPU the CUDA stages fail at once with a clear message (no hang); the host stage runs.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=$(mkdir -p "${OUT:-gpu-results}" && cd "${OUT:-gpu-results}" && pwd)
WORK=$(mktemp -d)  # everything is written here, then packed into $OUT
summary="$WORK/summary.txt"
elsewhere=$(mktemp -d)  # python -m puts the cwd first on sys.path: run the installed package from outside the checkout
TOTAL=0
START=$SECONDS
: > "$summary"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} AMPFUSED_BUILD_CUDA=1
export PYTHONUNBUFFERED=1  # a stage killed by its timeout keeps its log up to the kill
unset TRITON_INTERPRET

pack() {  # summary.txt and results.tar.gz into $OUT, each replaced atomically
    cp "$summary" "$OUT/.summary.tmp" && mv -f "$OUT/.summary.tmp" "$OUT/summary.txt"
    tar -czf "$OUT/.results.tmp" -C "$WORK" . 2>/dev/null && mv -f "$OUT/.results.tmp" "$OUT/results.tar.gz"
}

stage() {  # stage NAME TIMEOUT_S DIR COMMAND...   (DIR: where the command runs; output in $WORK/NAME.log)
    local name=$1 limit=$2 dir=$3; shift 3
    TOTAL=$((TOTAL + limit))
    if [ "$DRY" = 1 ]; then
        printf '%-10s %4ss  %s\n' "$name" "$limit" "$*" | tee -a "$summary"
        return 0
    fi
    local start=$SECONDS
    (cd "$dir" && timeout -k 5 "$limit" "$@") > "$WORK/$name.log" 2>&1
    local rc=$?
    local note=""
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" TIMEOUT"
    printf '%-10s rc=%-3s %4ss%s  %s\n' "$name" "$rc" $((SECONDS - start)) "$note" "$*" | tee -a "$summary"
    if [ "$rc" != 0 ]; then  # the error lines first (pip buries them), then the end of the log
        { grep -E "Error|FAILED|error:" "$WORK/$name.log" | grep -v "^ *note:" | tail -3; tail -3 "$WORK/$name.log"; } \
            | sed "s/^/    $name| /" | tee -a "$summary"
    fi
    pack
    return $rc
}

setup() {
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    git -C "$ROOT" log -1 --format='commit: %H %s' 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || echo "nvidia-smi: not found"
    python - <<'PY'
import platform, sys
import setuptools, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "setuptools", setuptools.__version__)
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", "SMs", p.multi_processor_count)
else:
    print("no CUDA device visible to torch")
major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
if (major, minor) < (77, 0):
    sys.exit(f"setuptools {setuptools.__version__} < 77: the pyproject license field needs 77+; "
             "this script's `pip install 'setuptools>=77'` failed (setuptools.log): install it, then rerun")
PY
}
# a venv's bundled setuptools is older than 77: try to upgrade it (fails fast without a network/wheel cache)
if [ "$DRY" = 0 ] && ! python -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    timeout 60 pip install -q --retries 0 --timeout 5 'setuptools>=77' > "$WORK/setuptools.log" 2>&1 || true
fi

export -f setup
stage setup 15 "$ROOT" bash -c setup || { echo "setup failed: see summary" | tee -a "$summary"; pack; exit 1; }
stage build 100 "$ROOT" pip install -v --no-build-isolation --no-deps .
build_rc=$?
stage info 10 "$elsewhere" python -m ampfused info
stage check 100 "$elsewhere" python -m ampfused check
if [ "$DRY" = 0 ] && ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA GPU here: the CUDA stages are skipped (they would only report that)" | tee -a "$summary"
    stage host 15 "$elsewhere" python "$ROOT/benchmarks/gpu_host_check.py" --tensors 148,291 --repeats 5 --out "$WORK/host.csv"
    echo "total: $((SECONDS - START))s, budget ${TOTAL}s" | tee -a "$summary"
    pack
    exit 0
fi
if [ "$build_rc" != 0 ]; then
    echo "build failed (rc=$build_rc): the tests would run a stale or CPU-only ampfused; see build.log" | tee -a "$summary"
fi
# (pytest, not python -m pytest: the installed ampfused with its _C, not the source tree; -n 0: one
# process on the one GPU, where pyproject.toml asks pytest-xdist for a worker per core)
stage gpu_tests 80 "$ROOT" pytest tests -q -rs -n 0 -m gpu -p no:cacheprovider --ignore=tests/compact \
    --junitxml="$WORK/gpu_tests.xml"
stage compact 35 "$ROOT" pytest tests/compact -k "cuda and not emulated" -q -rs -n 0 -p no:cacheprovider --junitxml="$WORK/compact.xml"
stage bench 50 "$elsewhere" python -m ampfused bench --device cuda --sweeps size --sizes 124M,1B --gate-steps 1 --out "$WORK/bench"
# (the GPU plan's memory cases: its 124M gpt2-like shapes and the largest --sizes, 1B)
stage memory 45 "$elsewhere" python -m ampfused bench --device cuda --sweeps memory --sizes 1B --gate-steps 1 --out "$WORK/memory"
stage host 15 "$elsewhere" python "$ROOT/benchmarks/gpu_host_check.py" --tensors 148,291,2000 --repeats 10 --out "$WORK/host.csv"
echo "total: $((SECONDS - START))s, budget ${TOTAL}s of stage timeouts" | tee -a "$summary"
pack
exit 0
