"""Argument checks shared by FusedAmpAdamW and ``functional.fused_amp_adamw``: one spelling of each rule.

Everything here raises before anything is written and reads no device value on the host (a
tensor beta is read once, at construction, as torch does).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _backends, _dtensor
from ._contract import KERNEL_DTYPES, is_dense

LOW_PRECISION = (torch.float16, torch.bfloat16)
# [note: wide params] float64 and complex params train as in torch.optim.AdamW (fp64 math; complex
# through view_as_real) but the kernels never see them: functional.run_step hands them to the
# reference passes inside the same step (one global norm, one skip flag), and their state is plain
# tensors of the param's dtype, outside the flat fp32 buffers (``_state``).
WIDE_DTYPES = (torch.float64, torch.complex64, torch.complex128)
PARAM_DTYPES = KERNEL_DTYPES + WIDE_DTYPES


def check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """torch.optim.AdamW's checks (same messages), for the defaults and every param group."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    elif not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate (lr): {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value (eps): {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor):  # as torch: a 1-element tensor, read as a float at each step
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element, got shape {tuple(beta.shape)}")
            beta = beta.item()
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i} (betas[{i}]): {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_options(lr, betas, eps, weight_decay, *, max_grad_norm, skip_nonfinite, keep_scaled_grads, differentiable,
                  backend) -> None:
    """FusedAmpAdamW's constructor arguments (``fused_amp_adamw`` checks its flags with :func:`check_flag`)."""
    check_hyperparameters(lr, betas, eps, weight_decay)
    check_max_grad_norm(max_grad_norm)
    check_flag(skip_nonfinite, "skip_nonfinite")
    check_flag(keep_scaled_grads, "keep_scaled_grads")
    if differentiable:
        raise ValueError("differentiable=True is not supported by FusedAmpAdamW")
    if backend is not None:
        _backends.check_name(backend)


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
    if not is_dense(p):
        raise ValueError(
            f"parameter of shape {tuple(p.shape)} with strides {p.stride()} is a view with gaps or overlaps "
            "(e.g. a slice or an expand of another tensor): FusedAmpAdamW steps dense params of any memory format; "
            "pass a tensor of its own (p.clone() or p.contiguous())")
    if _dtensor.is_dtensor(p) and p.dtype in LOW_PRECISION and fp32_grad_accumulation:
        raise ValueError(
            "fp32_grad_accumulation=True with a DTensor (FSDP2) parameter: FSDP2 writes the sharded gradients itself; "
            "keep the sharded params fp32 and ask FSDP2 for fp32 gradients with "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    if device is not None and p.device != device:
        raise ValueError(f"params on several devices ({device} and {p.device}): use one FusedAmpAdamW per device")
    return p.device


def check_grad(p: Tensor, grad: Tensor) -> None:
    """A gradient the passes can read for ``p``: dense, same shape and device, a kernel dtype.

    [note: one grad check] The one Python check of a gradient: the optimizer runs it when it builds
    a step plan (and at each adoption into fp32 storage), the functional API on every call; the
    Python backends trust it (the C++ ops keep their own checks: they are public through torch.ops).
    """
    if grad.is_sparse:
        raise RuntimeError("FusedAmpAdamW does not support sparse gradients")
    if grad.shape != p.shape:
        raise RuntimeError(f"gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(p.shape)}")
    # [note: grad dtype] autograd gives p.dtype, or p.grad_dtype when the user set one (fp32 grads
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
