"""Typed loads and stores through raw addresses, with fp32 math in registers.

Params and grads are fp32, fp16 or bf16; the dtype is a per-tensor runtime code
(``DTYPE_CODE``, ampfused._contract's DTYPE_ codes), uniform within a program, so the branches below
never diverge. ``mask=None`` means a full block: no predication, so 16-byte vector accesses.

bf16 values are moved as uint16 bits and converted with integer
ops, not ``.to(tl.bfloat16)``: widening is exact (``bits << 16``) and narrowing is
round-to-nearest-even by the classic ``bits + 0x7FFF + lsb`` (NaN kept quiet), which is what
torch's ``Tensor.to(torch.bfloat16)`` does. The Triton 3.6 interpreter's own fp32->bf16 cast
truncates, so ``.to`` would make the CPU checks disagree with the GPU; with integers both run the
same exact code, at no cost that matters in a memory-bound kernel.

16-bit pointers are declared 8-byte (not 16-byte) aligned on purpose:
then every access of a block, fp32 or 16-bit, has 4 contiguous elements a thread (16-byte fp32,
8-byte 16-bit vectors) and the compiler needs no shared-memory layout conversions between them.

The interpreter re-patches ``triton.language`` at every call of a nested
``@triton.jit`` function (its cost: docs/results/compact-tests-time.md), so the kernels call few helpers per block and these
helpers call none.
"""
import triton
import triton.language as tl

from ._contract_generated import DTYPE_F16, DTYPE_F32


@triton.jit
def load_f32(addr, dtype_code, offs, mask, ALIGNED: tl.constexpr):
    """Elements ``offs`` of the tensor at int64 address ``addr`` (fp32/fp16/bf16) as fp32."""
    if dtype_code == DTYPE_F32:
        fp32_ptr = addr.to(tl.pointer_type(tl.float32))
        if ALIGNED:
            fp32_ptr = tl.multiple_of(fp32_ptr, 16)
        x = tl.load(fp32_ptr + offs, mask=mask)
    elif dtype_code == DTYPE_F16:
        fp16_ptr = addr.to(tl.pointer_type(tl.float16))
        if ALIGNED:
            fp16_ptr = tl.multiple_of(fp16_ptr, 8)
        x = tl.load(fp16_ptr + offs, mask=mask).to(tl.float32)
    else:
        bf16_bits_ptr = addr.to(tl.pointer_type(tl.uint16))
        if ALIGNED:
            bf16_bits_ptr = tl.multiple_of(bf16_bits_ptr, 8)
        x = (tl.load(bf16_bits_ptr + offs, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def store_f32(addr, dtype_code, offs, x, mask, ALIGNED: tl.constexpr):
    """Write fp32 ``x`` to elements ``offs`` of the tensor at ``addr``, rounding to its dtype (RNE)."""
    if dtype_code == DTYPE_F32:
        fp32_ptr = addr.to(tl.pointer_type(tl.float32))
        if ALIGNED:
            fp32_ptr = tl.multiple_of(fp32_ptr, 16)
        tl.store(fp32_ptr + offs, x, mask=mask)
    elif dtype_code == DTYPE_F16:
        fp16_ptr = addr.to(tl.pointer_type(tl.float16))
        if ALIGNED:
            fp16_ptr = tl.multiple_of(fp16_ptr, 8)
        tl.store(fp16_ptr + offs, x.to(tl.float16), mask=mask)
    else:
        bf16_bits_ptr = addr.to(tl.pointer_type(tl.uint16))
        if ALIGNED:
            bf16_bits_ptr = tl.multiple_of(bf16_bits_ptr, 8)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x0040
        tl.store(bf16_bits_ptr + offs, tl.where(x != x, quiet_nan, rounded).to(tl.uint16), mask=mask)


@triton.jit
def typed_ptr(addr, DTYPE: tl.constexpr, ALIGN_BYTES: tl.constexpr, ALIGNED: tl.constexpr):
    """``addr`` as a pointer to DTYPE, hinted ALIGN_BYTES-aligned (4-element vectors) when ALIGNED."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, ALIGN_BYTES)
    return ptr
