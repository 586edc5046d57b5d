#!/usr/bin/env bash
# CI compile check of the CUDA kernels of ampfused._C (no GPU needed).
#
# Builds the extension with AMPFUSED_BUILD_CUDA=1 against a CUDA build of torch in a fresh venv, from
# a copy of the tracked tree (so the dev build/ and .so are never mixed in), then imports
# ampfused._C and checks that CPU and CUDA kernels are registered for every op, that the .so
# carries sm_90 code, and runs the CPU tier of tests/contract/test_compiled_ops.py under that torch.
#
# Knobs: AMPFUSED_CI_TORCH (default torch==2.14.1, a CUDA 13.0 build), AMPFUSED_CI_CUDA_VENV (venv
# path, default .ci-venv-cuda in the repo; reused when it already has that torch),
# TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default: number of cores).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_SPEC="${AMPFUSED_CI_TORCH:-torch==2.14.1}"
VENV="${AMPFUSED_CI_CUDA_VENV:-$ROOT/.ci-venv-cuda}"
PYTHON_BIN="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export AMPFUSED_BUILD_CUDA=1
start=$SECONDS
say() { echo "[cuda_build +$((SECONDS - start))s] $*"; }

# --- nvcc: PATH first, then the usual toolkit places (the build script resolves wrapper scripts)
if ! command -v nvcc >/dev/null 2>&1; then
  for dir in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$dir/nvcc" ]; then export PATH="$dir:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null 2>&1 || { echo "cuda_build: no nvcc found (PATH, /usr/local/cuda*/bin)" >&2; exit 1; }
say "nvcc: $(command -v nvcc) ($(nvcc --version | grep -o 'release [0-9.]*'))"
CUOBJDUMP="$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump /usr/local/cuda-*/bin/cuobjdump 2>/dev/null | head -1 || true)"

# --- venv with a CUDA build of torch
want="${TORCH_SPEC#torch==}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import sys, torch; sys.exit(not (torch.__version__.split('+')[0] == '$want' and torch.version.cuda))" 2>/dev/null; then
  say "reusing $VENV"
else
  rm -rf "$VENV"
  "$PYTHON_BIN" -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_SPEC" 2>&1 | grep -v "is ignored" || true
fi
"$VENV/bin/pip" install -q ninja pytest pytest-xdist numpy setuptools wheel 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'not a CUDA build of torch'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
# a toolkit without cuobjdump: Triton's wheel ships one
[ -n "$CUOBJDUMP" ] || CUOBJDUMP="$(ls "$VENV"/lib/python*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -1 || true)"
export CUOBJDUMP
say "venv ready"

# --- build from a copy of the tracked tree (plus untracked, unignored files)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ampfused-cuda-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK" 2>/dev/null) || \
  (cd "$ROOT" && tar --exclude=./build --exclude='./.ci-venv*' --exclude='*.so' -cf - . | tar -xf - -C "$WORK")
say "building in $WORK (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS)"
if ! (cd "$WORK" && "$VENV/bin/pip" install -v --no-build-isolation --no-deps . >"$WORK/build.log" 2>&1); then
  grep -v "is ignored" "$WORK/build.log" | tail -60
  echo "cuda_build: FAILED to build ampfused._C with CUDA kernels" >&2
  exit 1
fi
grep "ampfused build:" "$WORK/build.log" || true
say "build done"

# --- check: the installed ampfused._C has CPU and CUDA kernels for every op, and sm_90 code
cd "$WORK/tests" 2>/dev/null || cd /
"$VENV/bin/python" - <<'PY'
import glob, os, subprocess, sys
import torch
import ampfused
import ampfused._C as C
from ampfused import _compiled

print("ampfused._C:", C.__file__, "WITH_CUDA =", C.WITH_CUDA, "built against torch", C.TORCH_VERSION, "CPU ISA", C.CPU_ISA)
assert "site-packages" in C.__file__, f"imported the source tree's _C, not the installed one: {C.__file__}"
missing = [(op, key) for op in _compiled.OPS for key in ("CPU", "CUDA") if not _compiled.has_kernel(op, key)]
assert not missing, f"kernels not registered: {missing}"
assert C.WITH_CUDA == 1
backend, why = _compiled.get_backend("cpu")
assert backend is not None, why
print("cuda backend probe on this GPU-less machine:", _compiled.get_backend("cuda")[1] or "available")
try:
    out = subprocess.run([os.environ.get("CUOBJDUMP") or "cuobjdump", "--list-elf", C.__file__], capture_output=True, text=True).stdout
    archs = sorted(set(part for line in out.splitlines() for part in line.replace(".", " ").split() if part.startswith("sm_")))
    print("cubins:", archs)
    assert any(a.startswith("sm_90") for a in archs), "no sm_90 code in ampfused._C"
except FileNotFoundError:
    print("cuobjdump not found: architecture check skipped")
print("cuda_build: OK")
PY
say "import check done"
# CPU tier of the op tests under this torch (GPU tests skip here); pytest, not `python -m pytest`,
# so that `import ampfused` is the installed package with its _C, not the copied source tree
cd "$WORK" && "$VENV/bin/pytest" -q -n 0 -p no:cacheprovider tests/contract/test_compiled_ops.py
say "finished"
