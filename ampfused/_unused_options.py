"""Options that can have no effect on the params they were given: one warning each, naming why.

A memory or rounding option that does nothing on a model is almost always a mistake (the fp32 model
that was meant to be converted to bf16 first, a flag copied from another run); the step is still
exactly right, so it is a warning, not an error. It is given at construction, where torch users
expect feedback on their arguments; params added later with ``add_param_group`` may still use the
option, and the message says so.
"""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
from torch import Tensor

from ._contract import KERNEL_DTYPES, encoding_for

LATER = "; params added later with add_param_group would use it"


class UnusedOptionWarning(UserWarning):
    """An optimizer option that cannot change anything for the params it was given (filter it with
    ``warnings.filterwarnings("ignore", category=ampfused.UnusedOptionWarning)``)."""


def unused_options(params: Sequence[Tensor], master_mode: str, moments, stochastic_rounding: bool,
                   fp32_grad_accumulation, uses_main_grad: Callable[[Tensor], bool]) -> list[str]:
    """Why each option given (not left at its default) does nothing for ``params``: one sentence each.

    ``master_mode``/``moments``: ``_args.master_mode``/``_args.state_encoding`` of the options;
    ``uses_main_grad``: the optimizer's own rule for fp32 gradient storage. Float64/complex params
    keep state of their own dtype ([note: wide params] in ``_args``): no option reaches them.
    """
    kernel_params = [p for p in params if p.dtype in KERNEL_DTYPES]
    encodings = [(p.dtype, *encoding_for(p, master_mode, moments)) for p in kernel_params]
    reasons = []
    if master_mode in ("split16", "split8") and not any(master == master_mode for _, master, _ in encodings):
        reasons.append(f'master_weights="{master_mode}" has no effect: no param is fp16/bf16 (fp32 params are '
                       f"their own master){LATER}")
    # what rounds stochastically: _contract.compact_modes ("sr"), for the state these options lay out
    rounded = any(moment == "bf16" or (master == "none" and dtype == torch.bfloat16) for dtype, master, moment in encodings)
    if stochastic_rounding and not rounded:
        reasons.append("stochastic_rounding=True has no effect: nothing is ever rounded to bf16 without an exact "
                       "master (it applies to bf16 moments, state_dtype=torch.bfloat16, and to bf16 params with "
                       f"master_weights=False; here the moments are {_moments_here(encodings)} and "
                       f"{_params_here(encodings, master_mode)}){LATER}")
    if fp32_grad_accumulation is True and not any(map(uses_main_grad, params)):
        reasons.append("fp32_grad_accumulation=True has no effect: no param is fp16/bf16 (the gradients of fp32 "
                       f"params are fp32 already; DTensor gradients are FSDP2's){LATER}")
    return reasons


def _moments_here(encodings) -> str:
    kinds = sorted({moment for _, _, moment in encodings}) or ["fp32"]
    return " and ".join(kinds)


def _params_here(encodings, master_mode: str) -> str:
    if not any(dtype == torch.bfloat16 for dtype, _, _ in encodings):
        return "no param is bf16"
    return f'the bf16 params have {master_mode} masters'


def warn_unused_options(reasons: list[str], stacklevel: int) -> None:
    for reason in reasons:
        warnings.warn(f"ampfused: {reason}.", UnusedOptionWarning, stacklevel=stacklevel + 1)
