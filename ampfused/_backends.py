"""Lazy discovery of the backends that implement ampfused's passes, and the choice among them.

Every backend is a module (or an object) with the attributes of :class:`ampfused._contract.Backend`
(``NAME``, ``supports``, ``accumulate_``, ``grad_stats_``, ``adamw_update_``, ``scaler_update_``);
the ``reference`` module is their specification and the test oracle. Backends are found by module
name (``importlib``), so none of them imports this module back.

Nothing here runs at ``import ampfused``: backends are probed on first use and cached.
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

from ._contract import Backend  # a module or an object with these attributes

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
