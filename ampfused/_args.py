"""Argument checks shared by FusedAmpAdamW and ``functional.fused_amp_adamw``: one spelling of each rule.

Everything here raises before anything is written and reads no device value on the host (a
tensor beta is read once, at construction, as torch does).
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from . import _backends, _dtensor
from ._batch import check_tensor_lr
from ._contract import (KERNEL_DTYPES, MASTER_DTYPE_NAMES, MASTER_MODE_OF_DTYPE, check_master_weights, encoding_for,
                        master_mismatch, moment_encoding, packed_shape, scales_shape)
from ._layout import is_dense

LOW_PRECISION = (torch.float16, torch.bfloat16)
# [note: wide params] float64 and complex params train as in torch.optim.AdamW (fp64 math; complex
# through view_as_real) but the kernels never see them: functional.run_step hands them to the
# reference passes inside the same step (one global norm, one skip flag), and their state is plain
# tensors of the param's dtype, outside the flat fp32 buffers (``_state``).
WIDE_DTYPES = (torch.float64, torch.complex64, torch.complex128)
PARAM_DTYPES = KERNEL_DTYPES + WIDE_DTYPES


def check_hyperparameter_types(lr, betas, eps, weight_decay) -> None:
    """A TypeError naming the hyperparameter and the type it takes, where torch.optim.AdamW would fail
    on a comparison with a raw ``'<=' not supported`` TypeError (``lr="3e-4"``, ``eps=None``)."""
    check_number(lr, "lr", tensor_ok=True)
    check_number(eps, "eps")
    check_number(weight_decay, "weight_decay")
    if isinstance(betas, (tuple, list)):
        for i, beta in enumerate(betas):
            check_number(beta, f"betas[{i}]", tensor_ok=True)


def check_number(value, name: str, tensor_ok: bool = False) -> None:
    """``value`` is a real number (a Python or numpy one) or a Tensor, else a TypeError naming ``name``."""
    # a Tensor passes whether or not tensor_ok: torch compares a 1-element tensor as a number (its
    # value checks follow); tensor_ok only says what the message offers
    if isinstance(value, (Tensor, numbers.Real)):
        return
    kind = "a float or a 1-element Tensor" if tensor_ok else "a float"
    raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")


def check_hyperparameters(lr, betas, eps, weight_decay, read_beta=Tensor.item) -> None:
    """torch.optim.AdamW's checks, for the defaults and every param group: torch's message first (its own
    tests match it as a prefix), then the argument it names. ``read_beta`` reads a tensor beta's value
    (the step plan passes its cached reader, so a rebuilt group row does not sync per step)."""
    check_hyperparameter_types(lr, betas, eps, weight_decay)
    if isinstance(lr, Tensor):
        check_tensor_lr(lr)
    elif not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr} (lr)")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps} (eps)")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):  # torch's rule, and its message
        raise ValueError(f"betas must be either both floats or both Tensors, got {type(betas[0]).__name__} and "
                         f"{type(betas[1]).__name__}")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor):  # as torch: a 1-element tensor, read as a float at each step
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element, got shape {tuple(beta.shape)}")
            beta = read_beta(beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} (betas[{i}])")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_group_flags(amsgrad, maximize) -> None:
    """``amsgrad``/``maximize`` of a group: a bool (or 0/1). torch reads them as truth values, so a
    config string ``"False"`` would silently turn AMSGrad on; refuse anything that is not a yes/no."""
    for value, name in ((amsgrad, "amsgrad"), (maximize, "maximize")):
        if not (isinstance(value, numbers.Integral) and value in (0, 1)):
            check_flag(value, name)


def check_options(lr, betas, eps, weight_decay, *, max_grad_norm, skip_nonfinite, keep_scaled_grads, differentiable,
                  backend, master_weights=None, state_dtype=None, stochastic_rounding=False) -> None:
    """FusedAmpAdamW's constructor arguments (``fused_amp_adamw`` checks its flags with :func:`check_flag`)."""
    check_hyperparameters(lr, betas, eps, weight_decay)
    check_max_grad_norm(max_grad_norm)
    check_flag(skip_nonfinite, "skip_nonfinite")
    check_flag(keep_scaled_grads, "keep_scaled_grads")
    master_mode(master_weights)
    state_encoding(state_dtype)
    check_flag(stochastic_rounding, "stochastic_rounding")
    if differentiable:
        raise ValueError("differentiable=True is not supported by FusedAmpAdamW")
    if backend is not None:
        _backends.check_name(backend)


def master_mode(master_weights) -> str:
    """``master_weights`` as one of "fp32", "split16", "split8", "none" (DESIGN §9); raises on anything else."""
    if master_weights is None or master_weights is True or master_weights == "fp32":
        return "fp32"
    if master_weights is False:
        return "none"
    if isinstance(master_weights, str) and master_weights in ("split16", "split8"):
        return master_weights
    raise ValueError(f'master_weights must be None, True, "fp32", "split16", "split8" or False, got {master_weights!r}')


def state_encoding(state_dtype):
    """``state_dtype`` as torch.float32, torch.bfloat16, "int8" or "int4" (DESIGN §9); raises on anything else."""
    if state_dtype is None or state_dtype is torch.float32:
        return torch.float32
    if state_dtype is torch.bfloat16 or (isinstance(state_dtype, str) and state_dtype in ("int8", "int4")):
        return state_dtype
    raise ValueError(f'state_dtype must be None, torch.float32, torch.bfloat16, "int8" or "int4", got {state_dtype!r}')


def state_dtype_name(moments) -> str:
    """``state_encoding``'s value as ``repr`` shows it: float32, bfloat16, int8 or int4."""
    return moments if isinstance(moments, str) else str(moments).replace("torch.", "")


def check_param_group(param_group: dict, defaults: dict, existing: list, check_param) -> dict:
    """A param group as add_param_group takes it, every param (``check_param``) and hyperparameter checked."""
    params = param_group["params"]
    params = [params] if isinstance(params, Tensor) else list(params)
    param_group = {**param_group, "params": params}  # a generator must survive being read twice
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]  # named_parameters() gives (name, param)
    for p in tensors:
        check_param(p)
    if len({id(p) for p in tensors}) != len(tensors):
        # torch.optim.AdamW warns and applies such a param twice per step; one fused launch cannot
        raise ValueError("a parameter group lists the same parameter more than once: list each parameter once")
    _dtensor.check_params(existing + tensors)  # [distributed] DTensors: all or none, one mesh
    merged = {**defaults, **{k: v for k, v in param_group.items() if k != "params"}}
    check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
    check_group_flags(merged["amsgrad"], merged["maximize"])
    return param_group


def check_param_modes(p, mode: str, moments, stochastic: bool = False) -> None:
    """A param the compact modes can serve: a split master completes the params of
    ``_contract.MASTER_PARAM_DTYPES`` only (``_contract.check_master_weights``); blockwise int8 / int4
    moments and stochastic rounding of a DTensor need whole rows per shard ([note: blocks in rows])."""
    check_master_weights(p, mode)
    if _dtensor.is_dtensor(p):
        if moments in ("int8", "int4") and encoding_for(p, mode, moments)[1] == moments:
            _dtensor.check_rows_sharded(p, f'state_dtype="{moments}" (blocks within rows)')
        if stochastic:
            _dtensor.check_rows_sharded(p, "stochastic_rounding=True (bits keyed by the element's index in the whole tensor)")


def check_flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")


def check_max_grad_norm(value) -> None:
    if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ValueError(f"Invalid max_grad_norm: {value!r} (a positive finite float or None)")


def per_tensor(value, n: int, name: str) -> list:
    """A hyperparameter given once for all tensors, or once per tensor, as one entry per tensor."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} tensors")
        return list(value)
    return [value] * n


def check_param(p, fp32_grad_accumulation, device: torch.device | None) -> torch.device:
    """A parameter FusedAmpAdamW can step, on ``device`` (the optimizer's, None before its first param);
    returns the optimizer's device."""
    if not isinstance(p, Tensor):
        raise TypeError(f"optimizer params must be Tensors, got {type(p).__name__}")
    if p.dtype not in PARAM_DTYPES:
        raise ValueError(f"parameter dtype {p.dtype} is not supported: FusedAmpAdamW takes float32, float16, bfloat16, "
                         "float64, complex64 and complex128 params")
    if p.is_sparse:
        raise ValueError("sparse parameters are not supported by FusedAmpAdamW")
    check_no_overlap(p, "parameter")
    if _dtensor.is_dtensor(p) and p.dtype in LOW_PRECISION and fp32_grad_accumulation:
        raise ValueError(
            "fp32_grad_accumulation=True with a DTensor (FSDP2) parameter: FSDP2 writes the sharded gradients itself; "
            "keep the sharded params fp32 and ask FSDP2 for fp32 gradients with "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    if device is not None and p.device != device:
        raise ValueError(f"params on several devices ({device} and {p.device}): use one FusedAmpAdamW per device")
    return p.device


def check_no_overlap(p: Tensor, what: str) -> None:
    """A param whose elements share memory (an ``expand``) is refused: no step can write it, and torch's
    AdamW fails (for-loop/foreach) or corrupts memory (fused) on one.

    [note: non-dense params] A param with gaps (a strided slice) trains as in torch: the reference
    passes serve it in the same step (``functional.fallback_indices``), as they serve wide params;
    its state is dense (contiguous strides), as ``torch.zeros_like`` gives it.
    """
    if not is_dense(p) and _may_overlap(p):
        raise ValueError(
            f"{what} of shape {tuple(p.shape)} with strides {p.stride()} has elements that share memory (e.g. an "
            "expand of another tensor): no optimizer step can write it; pass a tensor of its own (p.clone())")


def _may_overlap(t: Tensor) -> bool:
    """False when no two elements of ``t`` can share memory: each stride, in increasing order, passes the
    farthest element the smaller ones reach (a strided slice passes; an expand's zero stride does not)."""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_grad(p: Tensor, grad: Tensor) -> None:
    """A gradient the passes can read for ``p``: dense, same shape and device, a kernel dtype.

    The one Python check of a gradient: the optimizer runs it when it builds
    a step plan (and at each adoption into fp32 storage), the functional API on every call; the
    Python backends trust it (the C++ ops keep their own checks: they are public through torch.ops).
    """
    if grad.is_sparse:
        raise RuntimeError("FusedAmpAdamW does not support sparse gradients")
    if grad.shape != p.shape:
        raise RuntimeError(f"gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(p.shape)}")
    # autograd gives p.dtype, or p.grad_dtype when the user set one (fp32 grads
    # for bf16 params are fine); the kernels read float32, float16 and bfloat16.
    if p.dtype in WIDE_DTYPES or grad.dtype in WIDE_DTYPES:
        if grad.dtype != p.dtype:
            raise RuntimeError(f"gradient of dtype {grad.dtype} for a {p.dtype} parameter: a float64 or complex "
                               "parameter takes a gradient of its own dtype")
    elif grad.dtype not in KERNEL_DTYPES:
        raise RuntimeError(
            f"gradient of dtype {grad.dtype} for a {p.dtype} parameter: FusedAmpAdamW reads float32, float16 and "
            "bfloat16 gradients")
    if grad.device != p.device:
        raise RuntimeError(f"gradient on {grad.device} for a parameter on {p.device}")


def check_compact_lists(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, moment_scales, rounding_seed) -> None:
    """The functional API's compact state (encodings told by dtypes: docs/design.md §9): consistent per tensor."""
    if rounding_seed is not None and (isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int)):
        raise TypeError(f"rounding_seed must be an int or None, got {type(rounding_seed).__name__}")
    if moment_scales is not None and len(moment_scales) != len(params):
        raise ValueError(f"moment_scales has {len(moment_scales)} entries for {len(params)} tensors")
    for i, p in enumerate(params):
        master, m, v, vmax = masters[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i]
        mode = None if master is None else MASTER_MODE_OF_DTYPE.get(master.dtype)
        why = master_mismatch(mode, p.dtype)  # None for no master, or one that completes the param
        if why is not None:
            raise ValueError(f"master_params[{i}] is {why}, but params[{i}] is {p.dtype}")
        if master is not None and mode is None:
            raise ValueError(f"master_params[{i}] has dtype {master.dtype}: expected {MASTER_DTYPE_NAMES}")
        scales = moment_scales[i] if moment_scales is not None else None
        kind = moment_encoding(m)
        if kind in ("int8", "int4"):
            if v.dtype != torch.uint8 or (vmax is not None and vmax.dtype != torch.uint8):
                raise ValueError(f"exp_avgs[{i}] holds {kind} codes: exp_avg_sqs[{i}] (and max_exp_avg_sqs[{i}]) must be uint8 codes")
            codes = tuple(p.shape) if kind == "int8" else packed_shape(p.shape)  # [note: int4 packing]
            if any(t is not None and tuple(t.shape) != codes for t in (m, v, vmax)):
                raise ValueError(f"tensor {i} has {kind} moments of a param of shape {tuple(p.shape)}: their codes take shape {codes}")
            blocks = scales_shape(p.shape)  # [note: blocks in rows]
            if (scales is None or len(scales) != 3 or any(s is not None and (s.dtype != torch.float32 or tuple(s.shape) != blocks) for s in scales)
                    or scales[0] is None or scales[1] is None or ((vmax is None) != (scales[2] is None))):
                raise ValueError(f"tensor {i} has {kind} moments: moment_scales[{i}] must be (exp_avg_scales, exp_avg_sq_scales, "
                                 f"max_exp_avg_sq_scales or None), fp32 tensors of shape {blocks} (rows, blocks per row)")
        else:
            if scales is not None:
                raise ValueError(f"moment_scales[{i}] is given but exp_avgs[{i}] is {m.dtype}, not int8 / int4 codes")
            if m.dtype in (torch.bfloat16, torch.float32) and (v.dtype != m.dtype or (vmax is not None and vmax.dtype != m.dtype)):
                raise ValueError(f"exp_avgs[{i}] is {m.dtype} but exp_avg_sqs[{i}] is {v.dtype}: one state dtype per tensor")
