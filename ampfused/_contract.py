"""The pass contract: what the optimizer, the dispatcher and every backend agree on.

A leaf module (torch, typing and the standard library only): everything in ``ampfused`` may import
it, it imports nothing of ``ampfused``. The kernels keep their own copies of the numbers
(``ampfused/kernels`` imports nothing of the package; ``csrc/contract.h`` spells them for C++ and
CUDA); ``tests/test_contract.py`` holds the copies equal.

A step is two passes that talk through one small fp32 device vector, ``stats`` (``STATS_SIZE``
slots): the stats pass writes it, ending with :func:`finish_`; the update pass reads it.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Protocol, Sequence

import torch
from torch import Tensor

# Slots of the stats vector.
NORM, SKIP, FACTOR, SUMSQ = 0, 1, 2, 3
STATS_SIZE = 4
CLIP_EPS = 1e-6  # the epsilon torch.nn.utils.clip_grad_norm_ adds to the norm
# Bytes of a launch scratch: the stats pass's ticket counter at byte 0, the update pass's at byte 8,
# from byte 16 the stats partials (two doubles a block, <= 4096 blocks).
SCRATCH_BYTES = 16 + 16 * 4096
# Bits of a hyperparameter group's flags.
FLAG_AMSGRAD, FLAG_MAXIMIZE = 1, 2
# Per-tensor dtype codes of the kernels' tables; its keys are the dtypes the kernels read and write.
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KERNEL_DTYPES = tuple(DTYPE_CODE)


class Hyper(NamedTuple):
    """Hyperparameters of one param group, shared by all tensors of the group."""

    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool

    @property
    def flags(self) -> int:
        return (FLAG_AMSGRAD if self.amsgrad else 0) | (FLAG_MAXIMIZE if self.maximize else 0)


def inv_scale_of(grad_scale: Tensor | None) -> Tensor | None:
    """``1 / grad_scale`` exactly as torch.amp.GradScaler.unscale_ computes it (fp64, rounded to fp32)."""
    return None if grad_scale is None else grad_scale.double().reciprocal().float().reshape(())


def finish_(stats: Tensor, grad_scale: Tensor | None, found_inf: Tensor | None, max_grad_norm: float | None, *,
            check_nonfinite: bool = True) -> None:
    """The stats pass's epilogue from ``stats[SUMSQ]`` and the element flag ``stats[SKIP]``.

    [note: skip only on elements] Only an inf/NaN element (or ``found_inf``) skips: a finite
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


class Backend(Protocol):
    """The passes every backend implements (a module or an object with these attributes).

    ``ampfused.reference`` is their specification and the test oracle; ``ampfused._backends``
    finds the others (``ampfused._compiled``: the ``"cpu"``/``"cuda"`` ops of ``ampfused._C``;
    ``ampfused.kernels``: Triton). Nothing in a pass reads a device value on the host.
    """

    NAME: str

    def supports(self, device: torch.device) -> str | None:
        """Why this backend cannot serve tensors on ``device``; ``None`` when it can."""

    def accumulate_(self, main_grad: Tensor, grad: Tensor) -> None:
        """``main_grad += grad`` in fp32 (``grad`` fp32/fp16/bf16, same shape)."""

    def grad_stats_(self, grads: Sequence[Tensor], grad_scale: Tensor | None, found_inf: Tensor | None,
                    max_grad_norm: float | None, stats: Tensor, scratch=None, *, check_nonfinite: bool = True) -> None:
        """One pass over the grads, then the finish, in one launch.

        ``u = grads[i].float() * inv_scale`` with ``inv_scale = float(1 / double(grad_scale))``
        (torch's unscale; ``grad_scale`` is a 1-element fp32 device tensor, the loss scale, or
        ``None`` meaning 1). ``found_inf`` is a 1-element fp32 device tensor (non-zero skips) or
        ``None``; ``max_grad_norm`` a float or ``None``. Overwrites ``stats``:
        ``stats[SUMSQ] = sum_i sum(u_i ** 2)`` (fp32, inf when it overflows);
        ``stats[SKIP] = 1.0`` if any element of any ``u_i`` is inf/NaN or ``found_inf`` is non-zero;
        ``stats[NORM] = sqrt(stats[SUMSQ])``, inf where that is finite but the step is skipped;
        ``stats[FACTOR] = inv_scale * min(1, max_grad_norm / (norm + CLIP_EPS))`` (``inv_scale``
        alone without clipping): :func:`finish_` is the finish's specification.
        ``check_nonfinite=False`` ignores the element flag (see :func:`finish_`).
        ``scratch``: the caller's ``functional.Scratch`` (launch counters and partials, a host
        memo) or ``None`` for a fresh one; a backend that needs none ignores it.
        """

    def adamw_update_(self, params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                      exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor | None], steps: Sequence[Tensor],
                      masters: Sequence[Tensor | None], group_ids: Sequence[int], groups: Sequence[Hyper], stats: Tensor,
                      *, scratch=None, grad_scale: Tensor | None = None, moment_scales=None,
                      rounding_seed: int | None = None) -> None:
        """One AdamW step over parallel per-tensor lists, in one launch.

        ``None`` entries in ``max_exp_avg_sqs`` / ``masters`` where a param has no AMSGrad buffer /
        no master copy. Tensor ``i`` takes the hyperparameters ``groups[group_ids[i]]`` (the
        caller groups them once: the optimizer by param group, the functional API by value).
        Grads are multiplied by ``stats[FACTOR]`` (clip coefficient / loss scale); when
        ``stats[SKIP]`` is non-zero nothing is written at all. With ``grad_scale`` the unscaled
        gradient ``g * inv_scale`` is written back into ``grads[i]`` (what torch's fused AdamW
        leaves in ``p.grad``). The grads come validated (``ampfused._args.check_grad``): same
        shape, device and memory layout as their param, a kernel dtype. ``scratch``: as above.

        Compact state (DESIGN §9; ``ampfused._compact`` specifies every encoding) is told by dtypes:
        ``masters[i]`` fp32 (a master copy), int16 (split16 low bits, bf16 params) or int8 (split8
        residual); moments fp32, bf16, or int8 codes of ``exp_avg`` with uint8 codes of
        ``exp_avg_sq``/``max_exp_avg_sq``, whose fp32 scales (one per 256 elements in the param's
        memory order) come in ``moment_scales[i] = (exp_avg_scales, exp_avg_sq_scales,
        max_exp_avg_sq_scales or None)`` (``moment_scales`` None, or None entries, for other tensors).
        ``rounding_seed``: None rounds every bf16 write to nearest even; an int rounds the bf16 writes
        without an exact master (bf16 moments, bf16 params without master) stochastically, with bits
        derived from (seed, i, element). A skipped step writes no buffer, compact ones included.
        A backend lists the encodings it serves in ``COMPACT_MODES`` (a subset of {"split16", "split8",
        "bf16", "int8", "sr"}; missing means none): ``functional.run_step`` hands the tensors whose
        encodings it lacks to ``ampfused.reference`` in the same step, and passes ``moment_scales`` /
        ``rounding_seed`` to a backend only when its share needs them.
        """

    def scaler_update_(self, found_inf: Tensor, scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                       skipped_steps: Tensor, consecutive_skips: Tensor, watch: Tensor | None, *, growth_factor: float,
                       backoff_factor: float, growth_interval: int, hysteresis: int, min_scale: float | None) -> None:
        """``ampfused.GradScaler.update``'s rules on the device in one launch (``reference.scaler_update_``
        is the specification); optional: the scaler falls back to the reference where it is missing."""


def is_dense(t: Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements (any dimension order, no gaps or
    overlaps): what every backend addresses as flat memory from ``data_ptr()``."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_flat_layout(t: Tensor, like: Tensor) -> bool:
    """Element k of ``t``'s memory is element k of ``like``'s (both contiguous, or equal strides)."""
    return (t.is_contiguous() and like.is_contiguous()) or (t.shape == like.shape and t.stride() == like.stride())
