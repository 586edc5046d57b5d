"""Typed loads and stores through raw addresses, with fp32 math in registers.

Params and grads are fp32, fp16 or bf16; the dtype is a per-tensor runtime code
(``_tables.DTYPE_CODE``: 0 fp32, 1 fp16, 2 bf16), uniform within a program, so the branches below
never diverge. ``mask=None`` means a full block: no predication, so 16-byte vector accesses.

[note: bf16 by bit manipulation] 16-bit values are moved as uint16 bits and bf16 is converted
with integer ops, not ``.to(tl.bfloat16)``: widening is exact (``bits << 16``) and narrowing is
round-to-nearest-even by the classic ``bits + 0x7FFF + lsb`` (NaN kept quiet), which is what
torch's ``Tensor.to(torch.bfloat16)`` does. The Triton 3.6 interpreter's own fp32->bf16 cast
truncates, so ``.to`` would make the CPU checks disagree with the GPU; with integers both run the
same exact code, at no cost that matters in a memory-bound kernel.

[note: few helpers] The interpreter re-patches ``triton.language`` at every call of a nested
``@triton.jit`` function (~1 ms each), so the kernels call few helpers per block and these
helpers call none.
"""
import triton
import triton.language as tl


@triton.jit
def load_f32(addr, dtype_code, offs, mask, ALIGNED: tl.constexpr):
    """Elements ``offs`` of the tensor at int64 address ``addr`` (fp32/fp16/bf16) as fp32."""
    ptr32 = addr.to(tl.pointer_type(tl.float32))
    ptr16 = addr.to(tl.pointer_type(tl.uint16))
    if ALIGNED:
        ptr32 = tl.multiple_of(ptr32, 16)
        ptr16 = tl.multiple_of(ptr16, 16)
    if dtype_code == 0:
        x = tl.load(ptr32 + offs, mask=mask)
    else:
        bits = tl.load(ptr16 + offs, mask=mask)
        if dtype_code == 1:
            x = bits.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def store_f32(addr, dtype_code, offs, x, mask, ALIGNED: tl.constexpr):
    """Write fp32 ``x`` to elements ``offs`` of the tensor at ``addr``, rounding to its dtype (RNE)."""
    ptr32 = addr.to(tl.pointer_type(tl.float32))
    ptr16 = addr.to(tl.pointer_type(tl.uint16))
    if ALIGNED:
        ptr32 = tl.multiple_of(ptr32, 16)
        ptr16 = tl.multiple_of(ptr16, 16)
    if dtype_code == 0:
        tl.store(ptr32 + offs, x, mask=mask)
    elif dtype_code == 1:
        tl.store(ptr16 + offs, x.to(tl.float16).to(tl.uint16, bitcast=True), mask=mask)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x0040
        tl.store(ptr16 + offs, tl.where(x != x, quiet_nan, rounded).to(tl.uint16), mask=mask)
