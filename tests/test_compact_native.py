"""csrc/compact_math.h and kernels/compact.py against the specification ampfused/_compact.py, bitwise.

The C++ header is compiled into a tiny C ABI shim (tests/compact_shim.cpp, no torch, not the
production extension) and called through ctypes; the Triton functions run in small test kernels
(through the interpreter on a CPU machine). Every comparison is on bit patterns; NaN only has to
stay NaN.
"""
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ampfused import _compact as C
from test_compact_encodings import BF16_FIELDS, FP16_FIELDS, every_high_half, random_in_binades, wide_range

ROOT = Path(__file__).resolve().parent.parent


def same_bits(actual, expected, what):
    """Bitwise equality of two tensors of one dtype, NaN == NaN whatever the payload."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, what
    if actual.is_floating_point():
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
        actual, expected = actual[~nan], expected[~nan]
        width = {2: torch.int16, 4: torch.int32}[actual.element_size()]
        actual, expected = actual.view(width), expected.view(width)
    bad = (actual != expected).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} of {expected.numel()} differ, first at {bad[:3].flatten().tolist()}"


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

@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++/clang++ or $CXX) to build tests/compact_shim.cpp")
    lib = tmp_path_factory.mktemp("compact_shim") / "libcompact_shim.so"
    cmd = [cxx, "-O2", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", f"-I{ROOT / 'csrc'}",
           str(ROOT / "tests" / "compact_shim.cpp"), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
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
    same_bits(torch.from_numpy(lo.view(np.int16)), slo, "split16 low")
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
