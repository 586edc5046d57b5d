#!/usr/bin/env bash
# What does not fit in benchmarks/gpu_check.sh's 6 minutes: the whole test suite on the GPU, the
# full configuration and size sweeps, the training benchmark. Several commands' worth of GPU time;
# run each line on its own when a GPU budget allows (each is bounded by its timeout).
#
#   OUT=/some/dir bash benchmarks/gpu_check_long.sh [--dry-run] [STEP...]   # STEP: tests bench train
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
WANT=" ${*:-tests bench train} "
OUT=$(mkdir -p "${OUT:-gpu-results-long}" && cd "${OUT:-gpu-results-long}" && pwd)
summary="$OUT/summary.txt"
: > "$summary"
elsewhere=$(mktemp -d)

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    case "$WANT" in *" $name "*) ;; *) return 0 ;; esac
    if [ "$DRY" = 1 ]; then printf '%-8s %4ss  %s\n' "$name" "$limit" "$*" | tee -a "$summary"; return 0; fi
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    printf '%-8s rc=%-3s %4ss  %s\n' "$name" "$?" $((SECONDS - start)) "$*" | tee -a "$summary"
}

step tests 540 pytest tests -q -rs -p no:cacheprovider --junitxml="$OUT/tests.xml"
(cd "$elsewhere" && step bench 540 python -m ampfused bench --device cuda --sweeps configs,size,tensors --sizes 1M,124M,1B --out "$OUT/bench")
(cd "$elsewhere" && step train 540 python "$ROOT/benchmarks/bench_train.py" --device cuda --out "$OUT/train")
[ "$DRY" = 0 ] && cat "$summary"
exit 0
