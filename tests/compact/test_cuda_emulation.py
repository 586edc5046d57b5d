"""The CUDA compact update's code (csrc/cuda/compact_update.cuh) on a machine without a GPU.

tests/compact/cuda_emulation.cpp compiles the device code with the host compiler (a stand-in
cuda_runtime.h; a block's threads as std::threads, warp shuffles through a barrier) and this file
runs the GPU tests of tests/compact/test_cuda_compact.py on it, on CPU tensors: the walk over
lanes, groups, tails and int8 blocks, the new scales, the encodings and the stochastic-rounding
bits (equal to the CPU kernel's) are checked here; the device's own arithmetic (intrinsics, fma
contraction, the shuffles themselves) only on a GPU. Every chunk takes the compact path, the fp32
twins of the tests included, and a block has 64 threads (two warps), so several warps take turns
within a chunk.
"""
import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import test_cuda_compact as T
from ampfused import _contract
from ampfused._contract import DTYPE_CODE, FACTOR, SKIP

ROOT = Path(__file__).resolve().parents[2]
MASTER_KIND = {torch.float32: _contract.MASTER_F32, torch.int16: _contract.MASTER_SPLIT16,
               torch.int8: _contract.MASTER_SPLIT8}
MOMENT_KIND = {torch.float32: _contract.MOMENT_F32, torch.bfloat16: _contract.MOMENT_BF16,
               torch.int8: _contract.MOMENT_INT8, torch.uint8: _contract.MOMENT_INT8}
THREADS = 64
CTYPES = {"void*": ctypes.c_void_p, "float*": ctypes.c_void_p, "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32}


class UpdateTensor(ctypes.Structure):
    """The C++ record, field for field from its one definition (csrc/contract_generated.h is generated from it)."""
    _fields_ = [(f.name, CTYPES[f.ctype]) for f in _contract.UPDATE_TENSOR]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++/clang++ or $CXX) to build tests/compact/cuda_emulation.cpp")
    lib = tmp_path_factory.mktemp("cuda_emulation") / "libcuda_emulation.so"
    # the CPU kernels' flags, with the fmas the device and the x86 CPU builds take
    fma = ["-mfma"] if platform.machine() in ("x86_64", "AMD64") else []  # (aarch64 has it by default)
    cmd = [cxx, "-O2", "-ffp-contract=off", *fma, "-std=c++17", "-pthread", "-shared", "-fPIC",
           f"-I{ROOT / 'tests' / 'compact' / 'cuda_emulation'}", f"-I{ROOT / 'csrc'}",
           str(ROOT / "tests" / "compact" / "cuda_emulation.cpp"), "-o", str(lib)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(cmd)} failed:\n{built.stderr}"
    return ctypes.CDLL(str(lib))


def address(t):
    return None if t is None else t.data_ptr()


class EmulatedCuda:
    """adamw_update_ of the Backend protocol over the emulated compact chunks (as the op's checks
    build the records: ops_common.cpp)."""
    NAME = "cuda-emulated"
    COMPACT_MODES = frozenset({"split16", "split8", "bf16", "int8", "sr"})

    def __init__(self, lib):
        self.lib = lib

    def adamw_update_(self, batch, stats, *, scratch=None, grad_scale=None, rounding_seed=None):
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, group_ids, groups, moment_scales = (
            batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, batch.max_exp_avg_sqs, batch.steps,
            batch.masters, batch.group_ids, batch.groups, batch.moment_scales)
        if float(stats[SKIP]) != 0.0:
            return
        factor = float(stats[FACTOR])
        unscale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        for i, p in enumerate(params):
            h = groups[group_ids[i]]
            vmax = max_exp_avg_sqs[i] if h.amsgrad else None
            master = masters[i]
            scales = (moment_scales[i] if moment_scales is not None else None) or (None, None, None)
            tensors = [p, grads[i], exp_avgs[i], exp_avg_sqs[i], vmax, master]
            record = UpdateTensor(
                **dict(zip(("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"), map(address, tensors))),
                step=steps[i].data_ptr(),
                **dict(zip(("exp_avg_scales", "exp_avg_sq_scales", "max_exp_avg_sq_scales"), map(address, scales))),
                numel=p.numel(), param_dtype=DTYPE_CODE[p.dtype], grad_dtype=DTYPE_CODE[grads[i].dtype],
                group=group_ids[i], aligned=int(all(t is None or t.data_ptr() % (4 * t.element_size()) == 0 for t in tensors)),
                master_kind=MASTER_KIND[master.dtype] if master is not None else _contract.MASTER_F32,
                moment_kind=MOMENT_KIND[exp_avgs[i].dtype], stochastic=int(rounding_seed is not None),
                index=i if batch.index is None else batch.index[i])
            self.lib.emulated_update(
                ctypes.byref(record), ctypes.c_double(float(h.lr)), ctypes.c_double(h.beta1), ctypes.c_double(h.beta2),
                ctypes.c_double(h.eps), ctypes.c_double(h.weight_decay), ctypes.c_float(-factor if h.maximize else factor),
                ctypes.c_int(grad_scale is not None), ctypes.c_float(unscale),
                ctypes.c_uint64((rounding_seed or 0) & (2**64 - 1)), ctypes.c_int(record.moment_kind == _contract.MOMENT_INT8),
                ctypes.c_int(THREADS))


@pytest.fixture
def emulated(library, monkeypatch):
    monkeypatch.setattr(T, "BACKEND", EmulatedCuda(library))
    monkeypatch.setattr(T, "DEVICE", "cpu")


# the modes at sizes the emulation (512 thread starts per chunk) affords: a tail, two chunks for
# split16, int8 with a block cut by the end, and a tensor below the int8 threshold
MODES = [m for m in T.MODES if m.values[3] != T.N] + [
    pytest.param(*m.values[:3], 4096 + 300, id=m.id) for m in T.MODES if m.values[3] == T.N]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES)
def test_round_to_nearest_modes(emulated, param_dtype, master_weights, state_dtype, n, amsgrad):
    T.test_round_to_nearest_modes(param_dtype, master_weights, state_dtype, n, amsgrad)


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES[::3])
def test_several_steps(emulated, param_dtype, master_weights, state_dtype, n):
    T.test_several_steps(param_dtype, master_weights, state_dtype, n)


def test_two_chunks_and_unaligned_views(emulated, monkeypatch):
    monkeypatch.setattr(T, "N", 65536 + 300)
    T.test_round_to_nearest_modes(torch.bfloat16, "split16", "int8", 65536 + 300, True)
    T.test_unaligned_views_take_the_element_path(torch.float16, "split8", torch.float32)


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES)
def test_skipped_step_writes_nothing(emulated, param_dtype, master_weights, state_dtype, n):
    T.test_skipped_step_writes_nothing(param_dtype, master_weights, state_dtype, n)


def test_mixed_launch_with_grad_scale_write_back(emulated, monkeypatch):
    monkeypatch.setattr(T, "N", 4096 + 300)
    T.test_mixed_launch_with_grad_scale_write_back()


def test_split16_tie_rule(emulated):
    T.test_split16_tie_rule()


def test_int8_scales_are_block_maxima_and_nan_blocks_stay_nan(emulated):
    T.test_int8_scales_are_block_maxima_and_nan_blocks_stay_nan()


def test_stochastic_rounding_is_unbiased_and_seeded(emulated):
    T.test_stochastic_rounding_is_unbiased_and_seeded()


def test_stochastic_rounding_draws_the_cpu_kernels_bits(emulated, monkeypatch):
    monkeypatch.setattr(T, "N", 4096 + 300)
    T.test_stochastic_rounding_draws_the_cpu_kernels_bits()


def test_stochastic_rounding_leaves_exact_masters_exact(emulated, monkeypatch):
    monkeypatch.setattr(T, "N", 1000)
    T.test_stochastic_rounding_leaves_exact_masters_exact()
