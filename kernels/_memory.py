"""Typed loads and stores through raw addresses, with fp32 math in registers.

Every kernel reads fp32/fp16/bf16 memory as fp32 and writes fp32 results back in the memory's
dtype. The dtype is a per-tensor runtime code (``_tables.DTYPE_CODE``: 0 fp32, 1 fp16, 2 bf16);
it is uniform within a program, so the branches below never diverge.

[note: bf16 by bit manipulation] bf16 is converted with integer ops, not ``.to(tl.bfloat16)``:
the widening is exact (``bits << 16``) and the narrowing is round-to-nearest-even by the classic
``bits + 0x7FFF + lsb`` (NaN kept quiet), which is what torch's ``Tensor.to(torch.bfloat16)`` does.
The Triton 3.6 interpreter's own fp32->bf16 cast truncates, so using ``.to`` would make the CPU
checks disagree with the GPU; with integers both run the same, exact, code at the same cost.
"""
import triton
import triton.language as tl


@triton.jit
def typed(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """``addr`` (an int64 address) as a pointer to DTYPE; ALIGNED promises 16-byte alignment."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def block_offsets(first, BLOCK: tl.constexpr):
    """first, first+1, ..., first+BLOCK-1, with ``first`` a multiple of BLOCK (chunks start there)."""
    return tl.max_contiguous(tl.multiple_of(first + tl.arange(0, BLOCK), BLOCK), BLOCK)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store(ptrs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, x, mask=mask)
    else:
        tl.store(ptrs, x)


@triton.jit
def bf16_bits_to_f32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """Round-to-nearest-even fp32 -> bf16, as uint16 bits."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x0040
    return tl.where(x != x, quiet_nan, rounded).to(tl.uint16)


@triton.jit
def load_f32(addr, dtype_code, offs, mask, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    """Elements ``offs`` of the tensor at ``addr`` (fp32/fp16/bf16 by ``dtype_code``) as fp32."""
    if dtype_code == 0:
        x = _load(typed(addr, tl.float32, ALIGNED) + offs, mask, MASKED)
    elif dtype_code == 1:
        x = _load(typed(addr, tl.float16, ALIGNED) + offs, mask, MASKED).to(tl.float32)
    else:
        x = bf16_bits_to_f32(_load(typed(addr, tl.uint16, ALIGNED) + offs, mask, MASKED))
    return x


@triton.jit
def store_f32(addr, dtype_code, offs, x, mask, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    """Write fp32 ``x`` to elements ``offs`` of the tensor at ``addr``, rounding to its dtype (RNE)."""
    if dtype_code == 0:
        _store(typed(addr, tl.float32, ALIGNED) + offs, x, mask, MASKED)
    elif dtype_code == 1:
        _store(typed(addr, tl.float16, ALIGNED) + offs, x.to(tl.float16), mask, MASKED)
    else:
        _store(typed(addr, tl.uint16, ALIGNED) + offs, f32_to_bf16_bits(x), mask, MASKED)
