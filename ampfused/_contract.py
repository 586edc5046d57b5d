"""The pass contract: what the optimizer, the dispatcher and every backend agree on.

A leaf module (torch, typing and the standard library only): everything in ``ampfused`` may import
it, it imports nothing of ``ampfused``. It is the one definition of every fact the backends share:
``csrc/contract_generated.h`` (C++ and CUDA), ``csrc/contract_aten_generated.h`` (the dtype tables
over ATen's ScalarType) and ``kernels/_contract_generated.py`` (Triton, which imports nothing of the
package) are generated from the section below by ``python csrc/generate_contract.py`` and committed;
tests/contract/test_contract_generated.py fails when they are stale or when another source file
spells one of these facts itself.

A step is two passes that talk through one small fp32 device vector, ``stats`` (``STATS_SIZE``
slots): the stats pass writes it, ending with :func:`finish_`; the update pass reads it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

# ------------------------------------------------------------------ the shared facts
# Everything from here to the records is generated into C++/CUDA and Triton (SHARED names the C++
# spelling of each); csrc/generate_contract.py reads these names, so keep them plain values.

# Slots of the stats vector: one fp32 vector the stats pass writes and the update pass reads.
NORM = 0    # the gradient norm (inf on a skipped step whose norm was finite)
SKIP = 1    # 1: skip the update, 0: step
FACTOR = 2  # what every gradient is multiplied by: 1/scale, times the clip coefficient
SUMSQ = 3   # the sum of squares of the unscaled gradients
STATS_SIZE = 4
CLIP_EPS = 1e-6  # the epsilon torch.nn.utils.clip_grad_norm_ adds to the norm

# [note: scratch] The caller's uint8 launch scratch, zero between launches (the last block of each
# launch resets its counter): the tickets and partials of the kernels' last-block logic. One per
# optimizer, so two optimizers on two streams, or two replayed CUDA graphs, never share a counter.
SCRATCH_STATS_COUNTER = 0   # byte offset of the stats pass's ticket counter
SCRATCH_UPDATE_COUNTER = 8  # byte offset of the update pass's ticket counter
SCRATCH_PARTIALS = 16       # byte offset of the stats partials: two doubles per block
SCRATCH_BLOCKS = 4096       # the most blocks a launch may have (partials for each)
SCRATCH_BYTES = SCRATCH_PARTIALS + 2 * 8 * SCRATCH_BLOCKS

# Bits of a hyperparameter group's flags.
FLAG_AMSGRAD = 1
FLAG_MAXIMIZE = 2

# Per-tensor dtype codes of the kernels' records: the element types they read and write.
DTYPE_F32 = 0
DTYPE_F16 = 1
DTYPE_BF16 = 2

# How a group's lr is read: LR_VALUE from the record's lr, LR_SLOT from a kernel argument (Triton:
# the record's lr_ptr holds the slot), the others from a one-element tensor of that dtype at lr_ptr
# when the kernel runs (no host sync).
LR_VALUE = 0
LR_F32 = 1
LR_F16 = 2
LR_BF16 = 3
LR_F64 = 4
LR_SLOT = 5

# Compact state (DESIGN §9, ampfused/_compact.py): how a tensor's master and moments are stored.
MASTER_F32 = 0      # an fp32 master, or none
MASTER_SPLIT16 = 1  # low halves of the fp32 master (bf16 params), as bf16 bit patterns: [note: split16 dtype]
MASTER_SPLIT8 = 2   # int8 residuals in ulp(p)/256 (bf16 and fp16 params)
MOMENT_F32 = 0      # fp32 exp_avg / exp_avg_sq / max_exp_avg_sq
MOMENT_BF16 = 1     # bf16 moments (round to nearest even, or stochastic)
MOMENT_INT8 = 2     # int8 exp_avg / uint8 exp_avg_sq codes, fp32 scales per SCALE_BLOCK elements
MOMENT_INT4 = 3     # 4-bit codes of both moments, two per uint8 byte ([note: int4 packing]), fp32 scales per SCALE_BLOCK
SCALE_BLOCK = 256            # elements per int8 / int4 block (one fp32 scale each), within a row: [note: blocks in rows]
SMALL_TENSOR_NUMEL = 4096   # tensors with fewer elements (or one dimension) keep fp32 moments under "int8" / "int4"
# The int8 code grids ([note: float-like grids] in ampfused/_compact.py): mantissa bits and the code of 1.0.
SIGNED_MANT = 3   # exp_avg: sign + 4-bit exponent + 3-bit mantissa
SIGNED_ONE = 120
SQRT_MANT = 4     # sqrt(exp_avg_sq): 4-bit exponent + 4-bit mantissa
SQRT_ONE = 240
# [note: int4 grids] The 4-bit grids (ampfused/_compact.py): 16 levels each, ascending, in units of the block
# scale; a code is the index of its level. Chosen by measurement: docs/results/int4-grids.md.
# exp_avg (scale max |m|): sign + E2M1 magnitudes with 1 on top (1, 0.75, 0.5, 0.375, 0.25), two powers of two
# below (1/8, 1/16) and 0 (twice: the 16th code), steps of at most 2x everywhere and 1.5x above 1/4
INT4_SIGNED_LEVELS = tuple(sorted([s * x for s in (-1, 1) for x in (1.0, 0.75, 0.5, 0.375, 0.25, 0.125, 0.0625)]
                                  + [0.0, 0.0]))
# sqrt(exp_avg_sq) (scale max sqrt(v)): E3M1 without zero, 2^-e and 0.75 * 2^-e for e = 0 .. 7, so that v
# never decodes to 0 in a block whose maximum is not 0 (the paper's zero-point problem)
INT4_SQRT_LEVELS = tuple(sorted(f * 2.0 ** -e for e in range(8) for f in (0.75, 1.0)))



def _fp32(x: float) -> float:
    """``x`` rounded to fp32 (RNE), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).float().item()


# The levels as fp32, and the 15 decision bounds between neighbours (fp32 midpoints): a scaled value
# y gets the code of how many bounds lie strictly below it ([note: int4 grids] in _compact.py).
INT4_SIGNED_LEVELS = tuple(_fp32(x) for x in INT4_SIGNED_LEVELS)
INT4_SQRT_LEVELS = tuple(_fp32(x) for x in INT4_SQRT_LEVELS)
INT4_SIGNED_BOUNDS = tuple(_fp32((a + b) / 2) for a, b in zip(INT4_SIGNED_LEVELS, INT4_SIGNED_LEVELS[1:]))
INT4_SQRT_BOUNDS = tuple(_fp32((a + b) / 2) for a, b in zip(INT4_SQRT_LEVELS, INT4_SQRT_LEVELS[1:]))

# [note: rounding bits] Stochastic rounding's one counter-based hash (ampfused/_compact.py
# random_words is its specification; csrc/compact_random.h, kernels/_compact_state.py the same in
# C++/CUDA and Triton), integer-only so every backend draws the same bits. mix is "lowbias32"
# (C. Wellons' hash-prospector), a bijective 32-bit avalanche; the seed enters as two
# ROUNDING_SEED_BITS-bit words (its low 62 bits: Triton takes them as int32 arguments):
#   key  = mix(mix(mix(mix(index + SR_KEY_SALT) ^ seed_lo) ^ seed_hi) ^ (k >> 32))
#   y    = mix((k & 0xFFFFFFFF) ^ key);  word0 = mix(y ^ SR_WORD0_SALT);  word1 = mix(y ^ SR_WORD1_SALT)
# for element k (in the param's memory order, counted in the whole tensor: a DTensor shard's elements
# from its offset, so a sharded run draws the bits of an unsharded one) of the tensor at ``index`` in
# the step's full lists.
# Low/high 16 bits of word0 round exp_avg / exp_avg_sq, those of word1 max_exp_avg_sq / the param.
ROUNDING_SEED_BITS = 31
SR_MIX_MUL1 = 0x21F0AAAD
SR_MIX_MUL2 = 0x735A2D97
SR_KEY_SALT = 0x3C6EF372     # the tensor index's salt in the key
SR_WORD0_SALT = 0x5BD1E995   # the salts of an element's two random words
SR_WORD1_SALT = 0x1B873593

# The kernels key all of a tensor's (a shard's) elements with one high word: a shard whose elements'
# indices in the whole tensor cross a multiple of 2^32 (a sharded tensor of over 2^32 elements) is
# stepped by the reference passes, which key each element (``crosses_high_word``).

# name -> (C++ name, C++ type, C++ namespace under ampfused, or "") of every constant above
SHARED = {
    "NORM": ("kStatsNorm", "int", ""), "SKIP": ("kStatsSkip", "int", ""), "FACTOR": ("kStatsFactor", "int", ""),
    "SUMSQ": ("kStatsSumsq", "int", ""), "STATS_SIZE": ("kStatsSize", "int", ""),
    "CLIP_EPS": ("kClipEps", "float", ""),
    "SCRATCH_STATS_COUNTER": ("kScratchStatsCounter", "int64_t", ""),
    "SCRATCH_UPDATE_COUNTER": ("kScratchUpdateCounter", "int64_t", ""),
    "SCRATCH_PARTIALS": ("kScratchPartials", "int64_t", ""), "SCRATCH_BLOCKS": ("kScratchBlocks", "int", ""),
    "SCRATCH_BYTES": ("kScratchBytes", "int64_t", ""),
    "FLAG_AMSGRAD": ("kFlagAmsgrad", "int32_t", ""), "FLAG_MAXIMIZE": ("kFlagMaximize", "int32_t", ""),
    "DTYPE_F32": ("kF32", "int32_t", ""), "DTYPE_F16": ("kF16", "int32_t", ""), "DTYPE_BF16": ("kBF16", "int32_t", ""),
    "LR_VALUE": ("kLrValue", "int32_t", ""), "LR_F32": ("kLrF32", "int32_t", ""), "LR_F16": ("kLrF16", "int32_t", ""),
    "LR_BF16": ("kLrBF16", "int32_t", ""), "LR_F64": ("kLrF64", "int32_t", ""), "LR_SLOT": ("kLrSlot", "int32_t", ""),
    "MASTER_F32": ("kMasterF32", "int32_t", ""), "MASTER_SPLIT16": ("kMasterSplit16", "int32_t", ""),
    "MASTER_SPLIT8": ("kMasterSplit8", "int32_t", ""), "MOMENT_F32": ("kMomentF32", "int32_t", ""),
    "MOMENT_BF16": ("kMomentBF16", "int32_t", ""), "MOMENT_INT8": ("kMomentInt8", "int32_t", ""),
    "MOMENT_INT4": ("kMomentInt4", "int32_t", ""),
    "SCALE_BLOCK": ("kBlock", "int", "compact"), "SMALL_TENSOR_NUMEL": ("kSmallTensorNumel", "int64_t", "compact"),
    "SIGNED_MANT": ("kSignedMant", "int", "compact"), "SIGNED_ONE": ("kSignedOne", "int", "compact"),
    "SQRT_MANT": ("kSqrtMant", "int", "compact"), "SQRT_ONE": ("kSqrtOne", "int", "compact"),
    "INT4_SIGNED_LEVELS": ("kInt4SignedLevels", "float[16]", "compact"), "INT4_SQRT_LEVELS": ("kInt4SqrtLevels", "float[16]", "compact"),
    "INT4_SIGNED_BOUNDS": ("kInt4SignedBounds", "float[15]", "compact"), "INT4_SQRT_BOUNDS": ("kInt4SqrtBounds", "float[15]", "compact"),
    "ROUNDING_SEED_BITS": ("kRoundingSeedBits", "int", "compact"), "SR_MIX_MUL1": ("kMixMul1", "uint32_t", "compact"),
    "SR_MIX_MUL2": ("kMixMul2", "uint32_t", "compact"), "SR_KEY_SALT": ("kKeySalt", "uint32_t", "compact"),
    "SR_WORD0_SALT": ("kWord0Salt", "uint32_t", "compact"), "SR_WORD1_SALT": ("kWord1Salt", "uint32_t", "compact"),
}

# [note: one encoding decision] What a tensor's state is (DESIGN §9) is told by the dtypes of its
# buffers, and decided by these tables and the functions below only: state creation
# (``_state.state_keys``, ``_compact.encode_state``), state dicts, the reference passes, the
# dispatcher (``functional.fallback_indices``), the Triton rows and the C++ op's checks (the tables
# are generated into kernels/_contract_generated.py, and over ATen's ScalarType into
# csrc/contract_aten_generated.h).
MASTER_ENCODINGS = {  # master mode -> (the master buffer's dtype, its MASTER_ code, its state key, what it holds)
    "fp32": (torch.float32, MASTER_F32, "master_param", "fp32 master"),
    "split16": (torch.bfloat16, MASTER_SPLIT16, "master_low16", "split16 low halves"),
    "split8": (torch.int8, MASTER_SPLIT8, "master_residual8", "split8 residuals"),
}
MOMENT_ENCODINGS = {  # moment mode -> ((exp_avg dtype, exp_avg_sq / max_exp_avg_sq dtype), its MOMENT_ code)
    "fp32": ((torch.float32, torch.float32), MOMENT_F32),
    "bf16": ((torch.bfloat16, torch.bfloat16), MOMENT_BF16),
    "int8": ((torch.int8, torch.uint8), MOMENT_INT8),
    "int4": ((torch.uint8, torch.uint8), MOMENT_INT4),  # packed: [note: int4 packing]
}
MASTER_PARAM_DTYPES = {  # master mode -> the param dtypes it completes (a mode not listed: any param with a master)
    "split16": (torch.bfloat16,),
    "split8": (torch.bfloat16, torch.float16),
}
# [note: split16 dtype] split16's low halves are 16-bit patterns, not numbers: they travel as bfloat16
# because collectives move no int16 (gloo refuses it, NCCL has no such type), so a DTensor of int16
# could not be gathered (full_state_dict, full_tensor()); and bfloat16, the param's own dtype, is
# the one float dtype that a cast to the param's dtype (torch's load policy) leaves bitwise alone.
# Nothing computes on them: every backend reads their bits. Checkpoints of the int16 form load
# (``_state_dict``, the same bits viewed).
MASTER_LOW16_LEGACY_DTYPE = torch.int16
MASTER_MODE_OF_DTYPE = {dtype: mode for mode, (dtype, _, _, _) in MASTER_ENCODINGS.items()}
# the mode of a tensor's moments by its exp_avg buffer's dtype (exp_avg_sq's uint8 is int8's and int4's)
MOMENT_MODE_OF_DTYPE = {dtypes[0]: mode for mode, (dtypes, _) in MOMENT_ENCODINGS.items()}


def dtype_names(dtypes) -> str:
    """"a", "a or b", "a, b or c": torch dtypes by name (``bfloat16``), or names already spelled, for a message (as
    the generated C++ spells them)."""
    names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


# Each master encoding for messages, its buffer's dtype and what it holds: "bfloat16 (split16 low halves)"
# (C++: master_description in csrc/contract_aten_generated.h).
MASTER_DESCRIPTIONS = {mode: f"{dtype_names([dtype])} ({holds})" for mode, (dtype, _, _, holds) in MASTER_ENCODINGS.items()}
# The master buffers a step takes, for a message: "float32 (fp32 master), bfloat16 (split16) or int8 (split8)"
# (C++: kMasterDtypeNames).
MASTER_DTYPE_NAMES = dtype_names(f"{dtype_names([dtype])} ({holds if code == MASTER_F32 else mode})"
                                 for mode, (dtype, code, _, holds) in MASTER_ENCODINGS.items())
# What each split master needs, for a message: "bfloat16 (split16 low halves), which needs a bfloat16 param"
# (C++: master_description + master_param_dtypes; Triton: MASTER_NEEDS by buffer dtype).
MASTER_NEEDS = {mode: f"{MASTER_DESCRIPTIONS[mode]}, which needs a {dtype_names(dtypes)} param"
                for mode, dtypes in MASTER_PARAM_DTYPES.items()}


# The moment buffers a step takes, for a message: "float32, bfloat16 or int8 / uint8 codes" (exp_avg's
# dtype / exp_avg_sq's where they differ); FLOAT_MOMENT_DTYPE_NAMES without the codes. (C++:
# kMomentDtypeNames, kFloatMomentDtypeNames; Triton: MOMENT_DTYPE_NAMES.)
def _moment_dtype_names(floats_only: bool) -> str:
    def name(a, b):
        if a.is_floating_point:
            return dtype_names([a])
        return f"{dtype_names([a])} / {dtype_names([b])} codes" if a != b else f"{dtype_names([a])} 4-bit codes"
    return dtype_names(name(a, b) for (a, b), _ in MOMENT_ENCODINGS.values() if a.is_floating_point or not floats_only)


MOMENT_DTYPE_NAMES = _moment_dtype_names(floats_only=False)
FLOAT_MOMENT_DTYPE_NAMES = _moment_dtype_names(floats_only=True)


def master_mismatch(mode: str, param_dtype) -> str | None:
    """Why a master of ``mode`` cannot complete a param of ``param_dtype`` (``MASTER_PARAM_DTYPES``), or
    None when it can: "bfloat16 (split16 low halves), which needs a bfloat16 param", as the C++ op says it."""
    if mode not in MASTER_PARAM_DTYPES or param_dtype in MASTER_PARAM_DTYPES[mode]:
        return None
    return MASTER_NEEDS[mode]


def check_master_weights(param: Tensor, master_weights: str) -> None:
    """The ``master_weights`` option against a param, for the optimizer and ``_compact.encode_state``
    alike: a split master completes only the ``MASTER_PARAM_DTYPES`` params (split16: bf16; fp16 params
    have no split16 form). Params without a master (``encoding_for``: fp32 and wider) pass. ValueError."""
    mode = encoding_for(param, master_weights, torch.float32)[0]
    why = master_mismatch(mode, param.dtype)
    if why is not None:
        name = dtype_names([param.dtype])
        others = " or ".join(f'"{other}"' for other in MASTER_ENCODINGS if master_mismatch(other, param.dtype) is None)
        raise ValueError(f'master_weights="{mode}" keeps {why}, not a {name} one: use master_weights={others} '
                         f"for {name} params")


def master_encoding(master: Tensor | None) -> str:
    """A master buffer's mode: "none" without one, else "fp32", "split16" or "split8" by its dtype."""
    if master is None:
        return "none"
    mode = MASTER_MODE_OF_DTYPE.get(master.dtype)
    if mode is None:
        raise TypeError(f"a master must be {MASTER_DTYPE_NAMES}, got {master.dtype}")
    return mode


def moment_encoding(exp_avg: Tensor) -> str:
    """A tensor's moment mode by its exp_avg buffer's dtype: "bf16", "int8" (int8 codes; exp_avg_sq
    uint8), "int4" (uint8: packed 4-bit codes) or "fp32" (fp32, and the wide params' own dtypes, which
    the reference passes step in their dtype)."""
    return MOMENT_MODE_OF_DTYPE.get(exp_avg.dtype, "fp32")


def compact_modes(param: Tensor, exp_avg: Tensor, master: Tensor | None, stochastic: bool) -> frozenset:
    """The ``COMPACT_MODES`` names a tensor's step needs (empty: the plain fp32-state step)."""
    needed = set()
    master_mode, moment_mode = master_encoding(master), moment_encoding(exp_avg)
    if master_mode in ("split16", "split8"):
        needed.add(master_mode)
    if moment_mode != "fp32":
        needed.add(moment_mode)
    if stochastic and (moment_mode == "bf16" or (master is None and param.dtype == torch.bfloat16)):
        needed.add("sr")
    return frozenset(needed)


def encoding_for(param: Tensor, master_weights: str, state_dtype) -> tuple[str, str]:
    """(master mode, moment mode) of a new state of ``param`` under the options (``master_weights``
    "fp32" / "split16" / "split8" / "none", ``state_dtype`` torch.float32 / torch.bfloat16 / "int8" /
    "int4"): a master for 16-bit params only; int8 / int4 moments for tensors of two or more dimensions
    and ``SMALL_TENSOR_NUMEL`` elements or more ([note: blocks in rows]), int4 only where the last
    dimension is even ([note: int4 packing])."""
    master = master_weights if param.dtype in (torch.float16, torch.bfloat16) else "none"
    if isinstance(state_dtype, str) and state_dtype in ("int8", "int4"):
        blockwise = param.dim() >= 2 and param.numel() >= SMALL_TENSOR_NUMEL
        if state_dtype == "int4":
            blockwise = blockwise and param.shape[-1] % 2 == 0
        moments = state_dtype if blockwise else "fp32"
    else:
        moments = "bf16" if state_dtype is torch.bfloat16 else "fp32"
    return master, moments


# [note: blocks in rows] Compact moments are blockwise: SCALE_BLOCK consecutive elements (in the
# param's memory order) share one scale, and blocks start at every row: a row is a slice along dim 0,
# ``row_numel = numel / shape[0]`` elements, whose last block may be short. FSDP2 shards params by
# whole rows (``Shard(0)``), so a shard holds whole blocks and the scales, ``[rows, blocks per row]``,
# are sharded on dim 0 like the param: codes and scales are DTensors placed as the param is, and a
# shard's blocks are the unsharded tensor's. A 1-D tensor (a bias, a norm's weight) has no rows that
# a shard boundary respects and keeps fp32 moments (``encoding_for``). The functions below take the
# tensor's full one-row form too (a flat vector: one row), which the specification's tests use.
def block_rows(shape) -> tuple[int, int]:
    """(rows, elements per row) of the block grid of a tensor of ``shape``: its dim-0 slices, or one
    row for a 0-d or 1-d tensor."""
    shape = tuple(shape)
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def crosses_high_word(element_base: int, numel: int) -> bool:
    """Whether the elements ``element_base .. element_base + numel - 1`` of a tensor (a shard from its
    offset) have more than one high word: the kernels key every element of an unsharded tensor by
    its chunk (chunks never cross a multiple of 2^32), of a shard by its first element
    ([note: rounding bits])."""
    return element_base != 0 and numel > 0 and (element_base >> 32) != ((element_base + numel - 1) >> 32)


def scales_shape(shape) -> tuple[int, ...]:
    """The shape of the per-block scales of a tensor of ``shape``: ``[rows, ceil(row_numel / SCALE_BLOCK)]``,
    or ``[blocks]`` for a 0-d or 1-d tensor."""
    rows, row_numel = block_rows(shape)
    per_row = -(-row_numel // SCALE_BLOCK)
    return (per_row,) if len(tuple(shape)) < 2 else (rows, per_row)


# [note: int4 packing] int4 codes are two per byte: the codes of elements 2i and 2i + 1 (in row-major
# order) are the low and high nibble of byte i, in a uint8 tensor of the param's shape with the last
# dimension halved (``packed_shape``). The last dimension is even (``encoding_for``), so every row and
# every block starts on a byte, a ``Shard(0)`` shard's codes are the unsharded tensor's rows, and the
# codes alone give back the param's shape. Element k's code is in byte k // 2 of a contiguous tensor.
def packed_shape(shape) -> tuple[int, ...]:
    """The shape of the packed int4 codes of a tensor of ``shape`` (its last dimension even): that
    dimension halved."""
    shape = tuple(shape)
    if not shape or shape[-1] % 2:
        raise ValueError(f"int4 codes pack pairs along the last dimension, which must be even: shape {shape}")
    return shape[:-1] + (shape[-1] // 2,)


# The kernels' dtype codes by torch dtype; its keys are the dtypes the kernels read and write.
DTYPE_CODE = {torch.float32: DTYPE_F32, torch.float16: DTYPE_F16, torch.bfloat16: DTYPE_BF16}
KERNEL_DTYPES = tuple(DTYPE_CODE)
# The LR_ kind of a one-element tensor lr by its dtype: the dtypes a kernel reads an lr in (an lr
# tensor of another dtype is copied to float32 first).
LR_KIND_OF_DTYPE = {torch.float32: LR_F32, torch.float16: LR_F16, torch.bfloat16: LR_BF16, torch.float64: LR_F64}


class Field(NamedTuple):
    """One field of a record the backends share: a C++ struct member and, where ``triton``, an
    int64 column of the Triton table (in this order; floats as their fp64 bit pattern)."""

    name: str
    ctype: str
    doc: str
    triton: bool = True


# One tensor of the update pass, as the op or the Triton builder checked it: the
# only per-tensor record. The CPU hot loops take element ranges of it, the CUDA update reads an
# array of it from device memory, the Triton update one int64 row of it per tensor; so it holds
# plain addresses and fixed-width integers only. Addresses are 0/nullptr where a tensor is absent.
UPDATE_TENSOR = (
    Field("param", "void*", "the param (its dtype code in param_dtype)"),
    Field("grad", "void*", "written only with a grad_scale: the unscaled gradient"),
    Field("exp_avg", "float*", "the moments: fp32, or the encoding moment_kind says"),
    Field("exp_avg_sq", "float*", ""),
    Field("max_exp_avg_sq", "float*", "nullptr without AMSGrad"),
    Field("master", "float*", "nullptr without a master copy; else fp32 or the encoding master_kind says"),
    Field("step", "float*", "one fp32 element, advanced once the update has read it"),
    Field("exp_avg_scales", "float*", "MOMENT_INT8 / MOMENT_INT4: the fp32 scale of each block (scales_shape); nullptr otherwise"),
    Field("exp_avg_sq_scales", "float*", ""),
    Field("max_exp_avg_sq_scales", "float*", ""),
    Field("numel", "int64_t", ""),
    Field("row_numel", "int64_t", "MOMENT_INT8 / MOMENT_INT4: elements per row; blocks start at each row ([note: blocks in rows])"),
    Field("element_base", "int64_t", "the index of element 0 in the whole tensor (a DTensor shard's offset, else 0): "
          "it keys the random bits with the element's own offset"),
    Field("param_dtype", "int32_t", "a DTYPE_ code"),
    Field("grad_dtype", "int32_t", "a DTYPE_ code"),
    Field("group", "int32_t", "index into the group records"),
    Field("aligned", "int32_t", "every address allows 4-element vector access (the fast path)"),
    Field("master_kind", "int32_t", "a MASTER_ code"),
    Field("moment_kind", "int32_t", "a MOMENT_ code (all of the tensor's moments alike)"),
    Field("stochastic", "int32_t", "1: bf16 writes without an exact master round stochastically (Triton: a launch constexpr)",
          triton=False),
    Field("index", "int32_t", "position in the step's full lists: with the seed, it keys the random bits "
          "([note: rounding bits] in _contract.py)"),
)

# One param group of the update pass: the only per-group record (C++: by value in a CUDA launch's
# arguments or in device memory; Triton: one int64 row per distinct hyperparameter set).
UPDATE_GROUP = (
    Field("lr", "double", "used with LR_VALUE"),
    Field("beta1", "double", ""),
    Field("beta2", "double", ""),
    Field("eps", "double", ""),
    Field("weight_decay", "double", ""),
    Field("lr_ptr", "const void*", "a tensor lr (LR_F32 .. LR_F64), read at kernel time; the slot with LR_SLOT"),
    Field("lr_kind", "int32_t", "an LR_ code"),
    Field("flags", "int32_t", "FLAG_AMSGRAD | FLAG_MAXIMIZE"),
)

# One grad of the stats pass.
STATS_TENSOR = (
    Field("grad", "const void*", ""),
    Field("numel", "int64_t", ""),
    Field("dtype", "int32_t", "a DTYPE_ code"),
    Field("aligned", "int32_t", "the address allows 4-element vector access"),
)

# record -> (C++ struct name, Triton column prefix)
RECORDS = {"UPDATE_TENSOR": ("UpdateTensor", "U_"), "UPDATE_GROUP": ("UpdateGroup", "G_"),
           "STATS_TENSOR": ("StatsEntry", "S_")}


def inv_scale_of(grad_scale: Tensor | None) -> Tensor | None:
    """``1 / grad_scale`` exactly as torch.amp.GradScaler.unscale_ computes it (fp64, rounded to fp32)."""
    return None if grad_scale is None else grad_scale.double().reciprocal().float().reshape(())


def finish_(stats: Tensor, grad_scale: Tensor | None, found_inf: Tensor | None, max_grad_norm: float | None, *,
            check_nonfinite: bool = True) -> None:
    """The stats pass's epilogue from ``stats[SUMSQ]`` and the element flag ``stats[SKIP]``.

    Only an inf/NaN element (or ``found_inf``) skips: a finite
    gradient whose fp32 sum of squares overflows has norm inf, steps unclipped without clipping,
    and with clipping gets ``coef = c / (inf + 1e-6) = 0`` -- both exactly what torch does.
    Kernel backends run this in the last program of their stats launch; a distributed caller can
    all-reduce ``stats[SUMSQ]`` and ``stats[SKIP]`` and run it again. ``check_nonfinite=False``
    (``skip_nonfinite=False`` without a scaler) ignores the element flag: only ``found_inf`` skips,
    and a non-finite norm gives the coefficient ``clip_grad_norm_`` computes (0 for inf, NaN for NaN).
    """
    norm = stats[SUMSQ].sqrt()
    skip = stats[SKIP] != 0
    if not check_nonfinite:
        skip = torch.zeros_like(skip)
    if found_inf is not None:
        skip = skip | (found_inf.reshape(-1).sum() != 0)
    inv_scale = inv_scale_of(grad_scale)
    factor = inv_scale if inv_scale is not None else torch.ones((), dtype=torch.float32, device=stats.device)
    if max_grad_norm is not None:
        # torch.nn.utils.clip_grad_norm_'s clamp(max_norm / (total_norm + 1e-6), max=1)
        factor = factor * (max_grad_norm / (norm + CLIP_EPS)).clamp(max=1.0)
    stats[NORM] = torch.where(skip & torch.isfinite(norm), math.inf, norm)  # a skipped step's norm is non-finite
    stats[SKIP] = skip.float()
    stats[FACTOR] = factor
