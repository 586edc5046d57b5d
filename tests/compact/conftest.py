"""The ``kernel`` fixture: every backend's compact update pass, so each behaviour file runs the same
cases on all of them. A backend this machine cannot run skips with the reason (no GPU, no Triton,
no compiled build, no C++ compiler).

``cuda-emulated`` is the CUDA compact update's device code (csrc/cuda/compact_update.cuh) compiled
with the host compiler (tests/compact/cuda_emulation.cpp: a stand-in cuda_runtime.h, a block's
threads as std::threads, warp shuffles through a barrier) and run on CPU tensors: the walk over
lanes, groups, tails and int8 / int4 blocks, the new scales, the encodings and the stochastic-rounding bits
are checked on a machine without a GPU; the device's own arithmetic (intrinsics, fma contraction,
the shuffles themselves) only on a GPU. Every chunk takes the compact path, the fp32 twins
included, and a block has 64 threads (two warps), so several warps take turns within a chunk.
"""
import ctypes
import os
import platform
import shutil
import subprocess

import pytest
import torch

from ampfused import _backends, _compiled, _contract
from ampfused._contract import DTYPE_CODE, FACTOR, SKIP
from helpers import DEVICE, ROOT, Kernel

CPU_N = 70_001  # more than one 65536-element work range (CPU) or chunk (CUDA), and a ragged tail
KERNELS = ("cpu", "triton", "cuda", "cuda-emulated")
EMULATION_THREADS = 64
_MASTER_KIND = {dtype: code for dtype, code, _, _ in _contract.MASTER_ENCODINGS.values()}
_MOMENT_KIND = {dtypes[0]: code for dtypes, code in _contract.MOMENT_ENCODINGS.values()}  # by the exp_avg's dtype
_CTYPES = {"void*": ctypes.c_void_p, "float*": ctypes.c_void_p, "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32}


class UpdateTensor(ctypes.Structure):
    """The C++ record, field for field from its one definition (csrc/contract_generated.h is generated from it)."""
    _fields_ = [(f.name, _CTYPES[f.ctype]) for f in _contract.UPDATE_TENSOR]


def _address(t):
    return None if t is None else t.data_ptr()


class EmulatedCuda:
    """adamw_update_ of the Backend protocol over the emulated compact chunks (as the op's checks
    build the records: ops_common.cpp). It does not validate its inputs: the op's checks are the
    compiled backends' (kernel.checks)."""
    NAME = "cuda-emulated"
    COMPACT_MODES = frozenset({"split16", "split8", "bf16", "int8", "int4", "sr"})

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
                **dict(zip(("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"), map(_address, tensors))),
                step=steps[i].data_ptr(),
                **dict(zip(("exp_avg_scales", "exp_avg_sq_scales", "max_exp_avg_sq_scales"), map(_address, scales))),
                numel=p.numel(), row_numel=_contract.block_rows(p.shape)[1],
                element_base=0 if batch.element_base is None else batch.element_base[i], param_dtype=DTYPE_CODE[p.dtype], grad_dtype=DTYPE_CODE[grads[i].dtype],
                group=group_ids[i], aligned=int(all(t is None or t.data_ptr() % (4 * t.element_size()) == 0 for t in tensors)),
                master_kind=_MASTER_KIND[master.dtype] if master is not None else _contract.MASTER_F32,
                moment_kind=_MOMENT_KIND[exp_avgs[i].dtype], stochastic=int(rounding_seed is not None),
                index=i if batch.index is None else batch.index[i])
            self.lib.emulated_update(
                ctypes.byref(record), ctypes.c_double(float(h.lr)), ctypes.c_double(h.beta1), ctypes.c_double(h.beta2),
                ctypes.c_double(h.eps), ctypes.c_double(h.weight_decay), ctypes.c_float(-factor if h.maximize else factor),
                ctypes.c_int(grad_scale is not None), ctypes.c_float(unscale),
                ctypes.c_uint64((rounding_seed or 0) & (2**64 - 1)), ctypes.c_int(EMULATION_THREADS))


@pytest.fixture(scope="session")
def cuda_emulation(tmp_path_factory):
    """tests/compact/cuda_emulation.cpp built once per session, with the CPU kernels' flags and the fmas
    the device and the x86 CPU builds take."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++/clang++ or $CXX) to build tests/compact/cuda_emulation.cpp")
    lib = tmp_path_factory.mktemp("cuda_emulation") / "libcuda_emulation.so"
    fma = ["-mfma"] if platform.machine() in ("x86_64", "AMD64") else []  # (aarch64 has it by default)
    cmd = [cxx, "-O2", "-ffp-contract=off", *fma, "-std=c++17", "-pthread", "-shared", "-fPIC",
           f"-I{ROOT / 'tests' / 'compact' / 'cuda_emulation'}", f"-I{ROOT / 'csrc'}",
           str(ROOT / "tests" / "compact" / "cuda_emulation.cpp"), "-o", str(lib)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(cmd)} failed:\n{built.stderr}"
    return EmulatedCuda(ctypes.CDLL(str(lib)))


def make_kernel(name, request):
    """The Kernel ``name``, or a skip naming what this machine lacks."""
    if name == "cpu":
        backend, why = _compiled.get_backend("cpu")
        if backend is None:
            pytest.skip(f"compiled CPU backend unavailable: {why}")
        return Kernel("cpu", backend, "cpu", CPU_N, 1 << 17, 65536, spec_bitwise=True,
                      master_rtol={"master_low16": 2 ** -13, "master_residual8": 2 ** -13})
    if name == "triton":
        backend, why = _backends.probe("triton")
        why = why if backend is None else backend.supports(DEVICE)
        if why:
            pytest.skip(f"triton backend unavailable on {DEVICE}: {why}")
        # a tail block and a second chunk in the interpreter (CHUNK 1024); the interpreter pays per element
        from ampfused.kernels import _runtime

        # a split8 master one residual unit (ulp(p)/256: 2^-18 of an fp16 param) from the spec's, where the
        # spec's torch ops round the fp32 math an ulp differently, as the CUDA kernel's
        return Kernel("triton", backend, DEVICE, 1300, 4096, _runtime.CHUNK,
                      master_rtol={"master_low16": 1e-6, "master_residual8": 2 ** -14})
    if name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("the CUDA backend needs a CUDA GPU; this machine has none")
        backend, why = _compiled.get_backend("cuda")
        if backend is None:
            pytest.skip(f"CUDA backend unavailable: {why}")
        # split8: an fp32 ulp of the math may move a residual by its unit, ulp(p)/256 (2^-15 relative for bf16)
        return Kernel("cuda", backend, "cuda", CPU_N, 1 << 16, 65536, master_rtol={"master_low16": 1e-6, "master_residual8": 2 ** -14})
    if name == "cuda-emulated":
        # the sizes the emulation (512 thread starts per chunk) affords: a tail, int8 blocks cut by the end
        return Kernel("cuda-emulated", request.getfixturevalue("cuda_emulation"), "cpu", 4096 + 300, 1 << 16, 65536,
                      master_rtol={"master_low16": 1e-6, "master_residual8": 2 ** -14}, checks=False)
    raise ValueError(name)


@pytest.fixture(params=KERNELS)
def kernel(request):
    """Every backend's compact update pass (see the module docstring)."""
    return make_kernel(request.param, request)


@pytest.fixture(params=("cpu", "triton", "cuda"))
def checked_kernel(request):
    """The backends whose op validates its inputs (not the host emulation, which runs the device code only)."""
    return make_kernel(request.param, request)


@pytest.fixture(params=("cuda", "cuda-emulated"))
def cuda_kernel(request):
    """The CUDA compact update: on the GPU, and its device code on the host."""
    return make_kernel(request.param, request)

