#!/usr/bin/env bash
# Optional integration group: installs transformers, lightning and accelerate into the CURRENT venv
# (torch pinned to the installed version, so pip never replaces it) and runs tests/integration.
# Fails when pytest fails or when no integration test ran (e.g. every package failed to import).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
torch_version=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')
constraints=$(mktemp)
log=$(mktemp)
trap 'rm -f "$constraints" "$log"' EXIT
echo "torch==$torch_version" > "$constraints"
"$python" -m pip install -q -c "$constraints" transformers lightning accelerate
"$python" -c 'import torch, transformers, lightning, accelerate; print("integration: torch", torch.__version__, "transformers", transformers.__version__, "lightning", lightning.__version__, "accelerate", accelerate.__version__)'
set +e
# the venv's pytest script, not `python -m pytest`, which would put the checkout ahead of the install
AMPFUSED_INTEGRATION=1 "$(dirname "$(command -v "$python")")/pytest" tests/integration -q -rs -p no:cacheprovider -n 0 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    echo "integration: pytest failed (exit $status)"
    exit "$status"
fi
passed=$(grep -Eo '[0-9]+ passed' "$log" | tail -1 | cut -d' ' -f1)
if [ "${passed:-0}" -eq 0 ]; then
    echo "integration: no integration test ran"
    exit 1
fi
echo "integration: ok ($passed passed)"
