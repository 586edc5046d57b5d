"""csrc/compact_math.h and kernels/compact.py against the specification ampfused/_compact.py, bitwise.

The C++ header is compiled into a tiny C ABI shim (tests/compact/compact_shim.cpp, no torch, not the
production extension) and called through ctypes; the Triton functions run in small test kernels
(through the interpreter on a CPU machine). Every comparison is on bit patterns; NaN only has to
stay NaN.
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from ampfused import _compact as C
from helpers import ROOT, same_bits
from test_compact_encodings import BF16_FIELDS, FP16_FIELDS, every_high_half, random_in_binades, wide_range

# NaN and inf inputs are the point; the Triton interpreter's numpy reports them as warnings
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def masters():
    return torch.cat([every_high_half(), random_in_binades(BF16_FIELDS, 64), random_in_binades(FP16_FIELDS, 256, seed=1)])


def moments(kind, n=37 * C.BLOCK + 19):
    x = wide_range(n, kind, seed=3)
    x[5 * C.BLOCK: 6 * C.BLOCK] = 0  # an all-zero block
    x[7 * C.BLOCK + 3] = float("nan")  # a non-finite block
    return x


def spec_codes(x, kind):
    codes, scales = C.quantize(x, kind)
    return codes, scales, C.dequantize(codes, scales, kind)


# ------------------------------------------------------------------ C++ (csrc/compact_math.h)

# The CPU files' flags, and an optimizing build that may contract and vectorize (the encodings must not care).
SHIM_FLAGS = {"O2-nocontract": ["-O2", "-fno-trapping-math", "-ffp-contract=off"], "O3-native-contract": ["-O3", "-march=native", "-ffp-contract=fast"]}


@pytest.fixture(scope="module", params=list(SHIM_FLAGS))
def shim(request, tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++/clang++ or $CXX) to build tests/compact/compact_shim.cpp")
    lib = tmp_path_factory.mktemp("compact_shim") / "libcompact_shim.so"
    cmd = [cxx, *SHIM_FLAGS[request.param], "-std=c++17", "-shared", "-fPIC", f"-I{ROOT / 'csrc'}",
           str(ROOT / "tests" / "compact" / "compact_shim.cpp"), "-o", str(lib)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(cmd)} failed:\n{built.stderr}"
    return ctypes.CDLL(str(lib))


def call(fn, *arrays_and_ints):
    """Call a shim function: numpy arrays become pointers, ints stay ints; n is appended."""
    args, n = [], None
    for a in arrays_and_ints:
        if isinstance(a, np.ndarray):
            assert a.flags.c_contiguous
            args.append(a.ctypes.data_as(ctypes.c_void_p))
            n = a.size if n is None else n
        else:
            args.append(ctypes.c_int(a))
    fn(*args, ctypes.c_int64(n))


def np_out(n, dtype):
    return np.zeros(n, dtype=dtype)


def test_cpp_bf16_rounding(shim):
    m = masters()
    x = m.numpy()
    out = np_out(x.size, np.uint16)
    call(shim.shim_rne16, x, out)
    same_bits(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16), C.round_bf16(m), "RNE16")
    rand = torch.randint(0, 1 << 16, m.shape, generator=torch.Generator().manual_seed(9))
    call(shim.shim_sr16, x, rand.numpy().astype(np.uint32), out)
    same_bits(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16), C.stochastic_round_bf16(m, rand), "SR16")


def test_cpp_fp16_conversions(shim):
    m = masters()
    out = np_out(m.numel(), np.uint16)
    call(shim.shim_fp16_rne, m.numpy(), out)
    same_bits(torch.from_numpy(out.view(np.int16)).view(torch.float16), m.to(torch.float16), "fp32 -> fp16")
    every = np.arange(1 << 16, dtype=np.uint16)
    back = np_out(every.size, np.float32)
    call(shim.shim_fp16_to_float, every, back)
    same_bits(torch.from_numpy(back), torch.from_numpy(every.view(np.int16)).view(torch.float16).float(), "fp16 -> fp32")


def test_cpp_split16(shim):
    m = masters()
    p, lo = np_out(m.numel(), np.uint16), np_out(m.numel(), np.uint16)
    call(shim.shim_split16, m.numpy(), p, lo)
    sp, slo = C.split16(m)
    same_bits(torch.from_numpy(p.view(np.int16)), sp.view(torch.int16), "split16 param")
    same_bits(torch.from_numpy(lo.view(np.int16)), slo.view(torch.int16), "split16 low")
    back = np_out(m.numel(), np.float32)
    call(shim.shim_join16, p, lo, back)
    same_bits(torch.from_numpy(back), C.join16(sp, slo), "join16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpp_split8(shim, dtype):
    m = masters()
    fp16 = int(dtype == torch.float16)
    p, q = np_out(m.numel(), np.uint16), np_out(m.numel(), np.int8)
    call(shim.shim_split8, m.numpy(), fp16, p, q)
    sp, sq = C.split8(m, dtype)
    nan = torch.isnan(m)  # NaN params: both NaN (payloads may differ), residual 0
    same_bits(torch.from_numpy(p.view(np.int16)).view(dtype), sp, "split8 param")
    same_bits(torch.from_numpy(q)[~nan], sq[~nan], "split8 residual")
    back = np_out(m.numel(), np.float32)
    call(shim.shim_join8, p, fp16, q, back)
    same_bits(torch.from_numpy(back), C.join8(sp, sq), "join8")


@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_cpp_int8_moments(shim, kind):
    x = moments(kind)
    codes, scales, decoded = spec_codes(x, kind)
    encode, decode, code_type = ((shim.shim_encode_exp_avg, shim.shim_decode_exp_avg, np.int8) if kind == "signed"
                                 else (shim.shim_encode_exp_avg_sq, shim.shim_decode_exp_avg_sq, np.uint8))
    out = np_out(x.numel(), code_type)
    call(encode, x.numpy(), scales.numpy(), out)
    same_bits(torch.from_numpy(out), codes, f"{kind} codes")
    back = np_out(x.numel(), np.float32)
    call(decode, out, scales.numpy(), back)
    same_bits(torch.from_numpy(back), decoded, f"{kind} decoded")


# ------------------------------------------------------------------ Triton (kernels/compact.py)

triton = pytest.importorskip("triton", reason="Triton is not installed")
import triton.language as tl  # noqa: E402

from ampfused.kernels import compact as K  # noqa: E402
from helpers import DEVICE  # noqa: E402

TRITON_BLOCK = 1024 if DEVICE.type == "cuda" else 16384  # the interpreter pays per program, not per element


@triton.jit
def _rounding_kernel(x_ptr, rand_ptr, rne_ptr, sr_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    rand = tl.load(rand_ptr + offs, mask=mask, other=0).to(tl.uint32)
    tl.store(rne_ptr + offs, K.bf16_rne_bits(x).to(tl.int32), mask=mask)
    tl.store(sr_ptr + offs, K.bf16_sr_bits(x, rand).to(tl.int32), mask=mask)


@triton.jit
def _split16_kernel(m_ptr, hi_ptr, lo_ptr, back_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    hi, lo = K.split16(tl.load(m_ptr + offs, mask=mask, other=0.0))
    tl.store(hi_ptr + offs, hi.to(tl.int32), mask=mask)
    tl.store(lo_ptr + offs, lo.to(tl.int32), mask=mask)
    tl.store(back_ptr + offs, K.join16(hi, lo), mask=mask)


@triton.jit
def _split8_kernel(m_ptr, bits_ptr, q_ptr, back_ptr, n, FP16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits, q = K.split8(tl.load(m_ptr + offs, mask=mask, other=0.0), FP16)
    tl.store(bits_ptr + offs, bits.to(tl.int32), mask=mask)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(back_ptr + offs, K.join8(bits, q, FP16), mask=mask)


@triton.jit
def _moment_kernel(x_ptr, scale_ptr, code_ptr, back_ptr, n, SIGNED: tl.constexpr, SCALE_EVERY: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + offs // SCALE_EVERY, mask=mask, other=1.0)
    if SIGNED:
        code = K.encode_exp_avg(x, scale)
        back = K.decode_exp_avg(code, scale)
    else:
        code = K.encode_exp_avg_sq(x, scale)
        back = K.decode_exp_avg_sq(code, scale)
    tl.store(code_ptr + offs, code, mask=mask)
    tl.store(back_ptr + offs, back, mask=mask)


def launch(kernel, n, *args, **constexprs):
    kernel[(triton.cdiv(n, TRITON_BLOCK),)](*args, n, BLOCK=TRITON_BLOCK, **constexprs)


def empty(n, dtype=torch.int32):
    return torch.empty(n, dtype=dtype, device=DEVICE)


def test_triton_bf16_rounding():
    m = masters()
    rand = torch.randint(0, 1 << 16, m.shape, generator=torch.Generator().manual_seed(9))
    rne, sr = empty(m.numel()), empty(m.numel())
    launch(_rounding_kernel, m.numel(), m.to(DEVICE), rand.to(torch.int32).to(DEVICE), rne, sr)
    same_bits(C._from_bits16(rne.cpu().long(), torch.bfloat16), C.round_bf16(m), "RNE16")
    same_bits(C._from_bits16(sr.cpu().long(), torch.bfloat16), C.stochastic_round_bf16(m, rand), "SR16")


def test_triton_split16():
    m = masters()
    hi, lo, back = empty(m.numel()), empty(m.numel()), empty(m.numel(), torch.float32)
    launch(_split16_kernel, m.numel(), m.to(DEVICE), hi, lo, back)
    sp, slo = C.split16(m)
    same_bits(C._from_bits16(hi.cpu().long(), torch.bfloat16), sp, "split16 param")
    same_bits(C._from_bits16(lo.cpu().long(), torch.int16), slo.view(torch.int16), "split16 low")
    same_bits(back.cpu(), C.join16(sp, slo), "join16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_split8(dtype):
    m = masters()
    bits, q, back = empty(m.numel()), empty(m.numel()), empty(m.numel(), torch.float32)
    launch(_split8_kernel, m.numel(), m.to(DEVICE), bits, q, back, FP16=dtype == torch.float16)
    sp, sq = C.split8(m, dtype)
    nan = torch.isnan(m)
    same_bits(C._from_bits16(bits.cpu().long(), dtype), sp, "split8 param")
    same_bits(q.cpu()[~nan], sq.to(torch.int32)[~nan], "split8 residual")
    same_bits(back.cpu(), C.join8(sp, sq), "join8")


@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_triton_int8_moments(kind):
    x = moments(kind)
    codes, scales, decoded = spec_codes(x, kind)
    code, back = empty(x.numel()), empty(x.numel(), torch.float32)
    launch(_moment_kernel, x.numel(), x.to(DEVICE), scales.to(DEVICE), code, back, SIGNED=kind == "signed",
           SCALE_EVERY=C.BLOCK)
    same_bits(code.cpu(), codes.to(torch.int32), f"{kind} codes")
    same_bits(back.cpu(), decoded, f"{kind} decoded")


@triton.jit
def _moment4_kernel(x_ptr, scale_ptr, code_ptr, back_ptr, n, SIGNED: tl.constexpr, SCALE_EVERY: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + offs // SCALE_EVERY, mask=mask, other=1.0)
    if SIGNED:
        code = K.encode_exp_avg4(x, scale)
        back = K.decode_exp_avg4(code, scale)
    else:
        code = K.encode_exp_avg_sq4(tl.sqrt_rn(x), scale)
        back = K.decode_exp_avg_sq4(code, scale)
    tl.store(code_ptr + offs, code, mask=mask)
    tl.store(back_ptr + offs, back, mask=mask)


def int4_moments(kind):
    """:func:`moments` of even length, and a block whose elements sit on the grid's bounds (ties take the lower level)."""
    x = moments(kind, n=37 * C.BLOCK + 20)
    bounds = torch.tensor(C.INT4_GRIDS[kind][1])
    x[9 * C.BLOCK: 10 * C.BLOCK] = 0
    ties = 9 * C.BLOCK + torch.arange(bounds.numel() + 1)
    x[ties] = torch.cat([bounds if kind == "signed" else bounds * bounds, torch.ones(1)])  # the block's maximum 1
    return x


@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_triton_int4_moments(kind):
    x = int4_moments(kind)
    codes, scales = C.quantize4(x, kind)
    code, back = empty(x.numel()), empty(x.numel(), torch.float32)
    launch(_moment4_kernel, x.numel(), x.to(DEVICE), scales.to(DEVICE), code, back, SIGNED=kind == "signed",
           SCALE_EVERY=C.BLOCK)
    same_bits(code.cpu(), C.unpack4(codes).to(torch.int32), f"{kind} codes")
    same_bits(back.cpu(), C.dequantize4(codes, scales, kind), f"{kind} decoded")
