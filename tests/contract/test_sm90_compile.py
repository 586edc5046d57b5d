"""Every Triton kernel (and passes.cu, when nvcc is found) compiled for sm_90 offline with
the configurations the code launches (every update variant with and without WRITE_GRAD), both from
this checkout: no contracted non-finite test, no spill in a hot loop, registers and shared memory
within budget, 128-bit accesses in every update variant's aligned block loop, the int4-moment variants at
the blocks per SM of their int8 twins; with nvcc, global loads/stores,
the compact update's loads before its stores, blocks and bytes in flight per SM of each update
variant, and no contracted product in the scalar routines. See tests/contract/sm90_compile.py."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")


def _missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for tool in ("ptxas", "cuobjdump"):
        if not (bin_dir / tool).exists():
            return f"Triton's NVIDIA backend has no {tool} ({bin_dir / tool})"
    return None


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_kernels_compile_for_sm90_within_the_rules():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the GPU code path and block sizes
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "_grad_stats_kernel" in done.stdout and "_adamw_update_kernel" in done.stdout
    assert "int4 moments against int8" in done.stdout  # the int4 variants were compiled beside their int8 twins
    root = str(SCRIPT.resolve().parents[2])
    assert f"source tree: {root} " in done.stdout  # the checkout's kernels, for Triton and nvcc alike
    if shutil.which("nvcc"):
        assert "est. share of HBM bandwidth" in done.stdout and "probe_scalars_decay" in done.stdout
