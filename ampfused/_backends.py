"""Lazy discovery of the backends that implement ampfused's passes, and the choice among them.

Every backend is a module (or an object) with the attributes of :class:`Backend`
(``NAME``, ``supports``, ``accumulate_``, ``grad_stats_``, ``adamw_update_``, ``scaler_update_``);
the ``reference`` module is their specification and the test oracle. Backends are found by module
name (``importlib``), so none of them imports this module back.

Nothing here runs at ``import ampfused``: backends are probed on first use and cached.
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Protocol

import torch
from torch import Tensor

from ._batch import Batch

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

    def grad_stats_(self, batch: Batch, grad_scale: Tensor | None, found_inf: Tensor | None,
                    max_grad_norm: float | None, stats: Tensor, scratch=None, *, check_nonfinite: bool = True) -> None:
        """One pass over ``grads = batch.grads``, then the finish, in one launch.

        ``u = grads[i].float() * inv_scale`` with ``inv_scale = float(1 / double(grad_scale))``
        (torch's unscale; ``grad_scale`` is a 1-element fp32 device tensor, the loss scale, or
        ``None`` meaning 1). ``found_inf`` is a 1-element fp32 device tensor (non-zero skips) or
        ``None``; ``max_grad_norm`` a float or ``None``. Overwrites ``stats``:
        ``stats[SUMSQ] = sum_i sum(u_i ** 2)`` (fp32, inf when it overflows);
        ``stats[SKIP] = 1.0`` if any element of any ``u_i`` is inf/NaN or ``found_inf`` is non-zero;
        ``stats[NORM] = sqrt(stats[SUMSQ])``, inf where that is finite but the step is skipped;
        ``stats[FACTOR] = inv_scale * min(1, max_grad_norm / (norm + CLIP_EPS))`` (``inv_scale``
        alone without clipping): :func:`ampfused._contract.finish_` is the finish's specification.
        ``check_nonfinite=False`` ignores the element flag (see :func:`~ampfused._contract.finish_`).
        ``scratch``: the caller's ``functional.Scratch`` (launch counters and partials, a host
        memo) or ``None`` for a fresh one; a backend that needs none ignores it.
        """

    def adamw_update_(self, batch: Batch, stats: Tensor, *, scratch=None, grad_scale: Tensor | None = None,
                      rounding_seed: int | None = None) -> None:
        """One AdamW step over the tensors of ``batch`` (its lists named below as they are), in one launch.

        ``None`` entries in ``max_exp_avg_sqs`` / ``masters`` where a param has no AMSGrad buffer /
        no master copy. Tensor ``i`` takes the group row ``groups[group_ids[i]]`` (the
        caller groups them once: the optimizer by param group, the functional API by value).
        Grads are multiplied by ``stats[FACTOR]`` (clip coefficient / loss scale); when
        ``stats[SKIP]`` is non-zero nothing is written at all. With ``grad_scale`` the unscaled
        gradient ``g * inv_scale`` is written back into ``grads[i]`` (what torch's fused AdamW
        leaves in ``p.grad``). The grads come validated (``ampfused._args.check_grad``): same
        shape, device and memory layout as their param, a kernel dtype. ``scratch``: as above.

        Compact state is told by the dtypes of ``masters[i]`` and the moments (which dtype means which
        encoding: docs/design.md §9, "told by dtypes"; ``ampfused._compact`` specifies every encoding);
        blockwise moments' fp32 scales come in ``batch.moment_scales[i] = (exp_avg_scales, exp_avg_sq_scales,
        max_exp_avg_sq_scales or None)`` (``moment_scales`` None, or None entries, for other tensors).
        ``rounding_seed``: None rounds every bf16 write to nearest even; an int rounds the bf16 writes
        without an exact master (bf16 moments, bf16 params without master) stochastically, with the
        bits of the one hash of (seed, ``batch.index[i]``, element) ([note: rounding bits]), the
        same on every backend. ``batch.index[i]`` is tensor ``i``'s position in the step's full
        lists (None: ``i``), so a tensor draws the same bits whichever share of a split step serves
        it. A skipped step writes no buffer, compact ones included.
        A backend lists the encodings it serves in ``COMPACT_MODES`` (a subset of {"split16", "split8",
        "bf16", "int8", "sr"}; missing means none): ``functional.run_step`` hands the tensors whose
        encodings it lacks to ``ampfused.reference`` in the same step, and gives a backend
        ``moment_scales`` / ``rounding_seed`` only when its share needs them.
        """

    def scaler_update_(self, found_inf: Tensor, scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                       skipped_steps: Tensor, consecutive_skips: Tensor, watch: Tensor | None, *, growth_factor: float,
                       backoff_factor: float, growth_interval: int, hysteresis: int, min_scale: float | None) -> None:
        """``ampfused.GradScaler.update``'s rules on the device in one launch (``reference.scaler_update_``
        is the specification); optional: the scaler falls back to the reference where it is missing."""


BACKEND_NAMES = ("cuda", "triton", "cpu", "reference")
ENV_VAR = "AMPFUSED_BACKEND"

# name -> (module or None, reason it is unavailable or the empty string)
_probed: dict[str, tuple[Backend | None, str]] = {}


def _probe_reference():
    return importlib.import_module("ampfused.reference"), ""


TRITON_HINT = 'pip install "triton>=3.6"'  # quoted: unquoted, a shell redirects `>=3.6` to a file
NUMPY_HINT = "Triton needs numpy, which is not installed; `pip install numpy`"


def _probe_triton():
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        if getattr(exc, "name", None) == "numpy":
            return None, NUMPY_HINT
        if getattr(exc, "name", None) in ("triton", None):
            return None, f"triton is not installed ({exc}); `{TRITON_HINT}`"
        return None, f"triton failed to import ({exc}); `{TRITON_HINT}`"
    try:
        module = importlib.import_module("ampfused.kernels")
    except ImportError as exc:
        if getattr(exc, "name", None) == "numpy":
            return None, NUMPY_HINT
        return None, f"ampfused.kernels failed to import: {exc}"
    if not hasattr(module, "adamw_update_"):
        return None, "ampfused.kernels has no Triton passes in this build"
    return module, ""


def _probe_compiled(device_type: str):
    # ampfused._compiled wraps the extension ampfused._C; get_backend("cpu"|"cuda") returns
    # (backend object with the passes, "") or (None, reason).
    try:
        module = importlib.import_module("ampfused._compiled")
    except ImportError as exc:
        return None, f"the compiled extension is not available: {exc}"
    return module.get_backend(device_type)


_PROBES = {
    "reference": _probe_reference,
    "triton": _probe_triton,
    "cpu": lambda: _probe_compiled("cpu"),
    "cuda": lambda: _probe_compiled("cuda"),
}


def probe(name: str) -> tuple[Backend | None, str]:
    """(module, "") when backend ``name`` is usable in this process, else (None, reason). Cached."""
    check_name(name)
    if name not in _probed:
        try:
            _probed[name] = _PROBES[name]()
        except Exception as exc:  # a broken build must never break ampfused
            _probed[name] = (None, f"probing failed: {type(exc).__name__}: {exc}")
    return _probed[name]


def check_name(name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; valid backends are {', '.join(map(repr, BACKEND_NAMES))} or None (auto)")


def _device_reason(module: Backend, device: torch.device) -> str:
    supports = getattr(module, "supports", None)
    return (supports(device) or "") if supports is not None else ""


def _auto_order(device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("cuda", "triton", "reference")
    # the Triton interpreter is for checking kernels, not for speed: only
    # an explicit request (backend="triton" or AMPFUSED_BACKEND=triton) uses it on CPU tensors.
    return ("cpu", "reference")


def resolve(requested: str | None, device: torch.device) -> tuple[Backend, str]:
    """Pick the backend for tensors on ``device``; returns (module, why it was chosen), the reason
    starting with the backend's name ("cpu: best available for cpu", "reference: requested").

    ``requested`` (or the AMPFUSED_BACKEND environment variable when it is None) forces one and
    raises RuntimeError with the reason when it cannot serve; None picks the best available.
    """
    requested_by_env = not requested and bool(os.environ.get(ENV_VAR))
    requested = requested or os.environ.get(ENV_VAR) or None
    if requested is not None:
        check_name(requested)
        module, reason = probe(requested)
        reason = reason or _device_reason(module, device)
        if reason:
            raise RuntimeError(f"ampfused backend {requested!r} is unavailable for {device.type} tensors: {reason}")
        return module, f"{requested}: requested" + (f" (through {ENV_VAR})" if requested_by_env else "")
    skipped = []
    for name in _auto_order(device):
        module, reason = probe(name)
        reason = reason or _device_reason(module, device)
        if not reason:
            why = f"{name}: best available for {device.type}" + (f" ({'; '.join(skipped)})" if skipped else "")
            if name == "reference" and device.type == "cuda":
                _warn_reference_on_cuda(skipped)
            return module, why
        skipped.append(f"{name}: {reason}")
    raise RuntimeError("no ampfused backend available: " + "; ".join(skipped))  # unreachable: reference serves all


class SlowBackendWarning(UserWarning):
    """A CUDA optimizer fell back to the pure-PyTorch ``reference`` backend (correct, but several times slower)."""


_warned_reference_on_cuda = False


def _warn_reference_on_cuda(skipped: list[str]) -> None:
    """Once per process: CUDA tensors on the reference backend because neither Triton nor ampfused._C serves them."""
    global _warned_reference_on_cuda
    if _warned_reference_on_cuda:
        return
    _warned_reference_on_cuda = True
    warnings.warn(
        "ampfused: CUDA params run on the slow pure-PyTorch 'reference' backend because no fused backend is "
        f"available ({'; '.join(skipped)}). Fix: `{TRITON_HINT}`, or build the CUDA kernels with "
        "`AMPFUSED_BUILD_CUDA=1 pip install --no-build-isolation .` (`python -m ampfused info` says what is missing); "
        "pass backend=\"reference\" to silence this.", SlowBackendWarning, stacklevel=3)


def report() -> list[tuple[str, bool, str]]:
    """(name, available, reason) for every backend, for `python -m ampfused info`."""
    rows = []
    for name in BACKEND_NAMES:
        module, reason = probe(name)
        if module is not None and name in ("cuda", "triton"):
            reason = _device_reason(module, torch.device("cuda"))
            if name == "triton" and reason:
                cpu_reason = _device_reason(module, torch.device("cpu"))
                reason = f"cuda: {reason}; cpu: {cpu_reason or 'available (interpreter)'}"
                rows.append((name, not cpu_reason, reason))
                continue
        rows.append((name, module is not None and not reason, reason))
    return rows
