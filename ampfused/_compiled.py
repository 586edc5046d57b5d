"""The compiled backends ``"cpu"`` and ``"cuda"``: thin Python over the ops of ``ampfused._C``.

The extension registers ``torch.ops.ampfused.{accumulate, grad_stats, adamw_update, scaler_update}`` with the
dispatcher (CPU kernels always, CUDA kernels when it was built with them); this module loads it
lazily, says why when it cannot, and adapts the passes of ``ampfused._backends.Backend`` to the op
signatures.

Nothing here runs at ``import ampfused``: ``_backends`` imports this
module on first use, and every failure to load the shared object (missing, built against another
torch, broken) becomes a reason string for ``python -m ampfused info``, never an exception.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import warnings

import torch
from torch import Tensor

from ._contract import LR_VALUE
from ._layout import is_dense, same_flat_layout

OPS = ("accumulate", "grad_stats", "adamw_update", "scaler_update")
BUILD_HINT = "run `pip install --no-build-isolation .` in an environment with torch to build it"

_loaded: tuple[object | None, str] | None = None
_fakes_registered = False


def load() -> tuple[object | None, str]:
    """(the ampfused._C module, "") or (None, why it cannot be used). Cached."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def _load() -> tuple[object | None, str]:
    try:
        module = importlib.import_module("ampfused._C")
    except ModuleNotFoundError as exc:
        if exc.name in ("ampfused._C", "_C"):
            built = _built_elsewhere()
            if built is None:
                return None, f"ampfused._C is not built (pure-Python install): {BUILD_HINT}"
            reason = (f"ampfused is imported from {_HERE}, which has no built ampfused._C, while the install in {built} "
                      "has one (`python -m` and scripts put the current folder first on sys.path, so inside a checkout "
                      "they import its source tree): run from outside the checkout, or build the checkout in place "
                      "with `pip install --no-build-isolation -e .`")
            warnings.warn(f"ampfused: the compiled cpu/cuda backends are unavailable: {reason}", stacklevel=4)
            return None, reason
        return None, f"ampfused._C failed to import: {exc}"
    except ImportError as exc:  # undefined symbol, wrong ABI, missing libtorch_cuda, ...
        return None, (f"ampfused._C failed to load ({exc}): a broken or stale build, or one built against another "
                      f"torch than this {torch.__version__}; rebuild it ({BUILD_HINT})")
    except Exception as exc:  # a broken build must never break ampfused
        return None, f"ampfused._C failed to load: {type(exc).__name__}: {exc}"
    missing = [op for op in OPS if not hasattr(torch.ops.ampfused, op)]
    if missing:
        return None, f"ampfused._C loaded but registers no {', '.join(missing)} op (stale build?): {BUILD_HINT}"
    _register_fakes()
    return module, ""


_HERE = os.path.dirname(os.path.abspath(__file__))


def _built_elsewhere() -> str | None:
    """Another ampfused folder on the import path that holds a built ``_C`` (an install shadowed by
    the source tree this process imported), or None."""
    folders = [os.path.join(entry or os.getcwd(), "ampfused") for entry in sys.path]
    for finder in sys.meta_path:  # editable installs map the package through a finder of their own
        try:
            spec = finder.find_spec("ampfused", None)
        except Exception:  # a third-party finder must never break ampfused
            continue
        folders += list(getattr(spec, "submodule_search_locations", None) or [])
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
        if folder != _HERE and any(os.path.isfile(os.path.join(folder, "_C" + suffix))
                                   for suffix in importlib.machinery.EXTENSION_SUFFIXES):
            return folder
    return None


def _register_fakes() -> None:
    """Fake (meta) kernels so torch.compile can trace the ops: they only mutate, returning nothing."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True
    for op in OPS:
        try:
            torch.library.register_fake(f"ampfused::{op}")(_no_output)
        except RuntimeError:  # already registered (e.g. a second import path): fine
            pass


def _no_output(*args, **kwargs) -> None:
    return None


def has_kernel(op: str, dispatch_key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"ampfused::{op}", dispatch_key)


def get_backend(device_type: str):
    """(backend object, "") for "cpu" or "cuda", or (None, why it is unavailable)."""
    if device_type not in ("cpu", "cuda"):
        return None, f"ampfused._C has no {device_type} kernels"
    if device_type == "cuda" and torch.version.cuda is None:
        # no rebuild of ampfused can help here: its CUDA kernels compile only against a CUDA torch
        return None, (f"torch {torch.__version__} is not a CUDA build: the cuda backend needs a CUDA build of "
                      "torch (https://pytorch.org/get-started/locally/); install one, then reinstall ampfused")
    module, reason = load()
    if module is None:
        return None, reason
    key = device_type.upper()
    if not all(has_kernel(op, key) for op in OPS):
        if device_type == "cuda":
            why = "no matching nvcc was found at build time, or AMPFUSED_BUILD_CUDA=0"
            return None, (f"ampfused._C was built without CUDA kernels ({why}); rebuild with "
                          "`AMPFUSED_BUILD_CUDA=1 pip install --no-build-isolation .` to see why")
        return None, f"ampfused._C has no CPU kernels (broken build): {BUILD_HINT}"
    if device_type == "cuda" and not torch.cuda.is_available():
        return None, "no CUDA device"
    return CompiledBackend(device_type, module), ""


def _laid_out(t: Tensor, like: Tensor | None) -> bool:
    """Whether the op can read grad ``t`` as it is: dense, and laid out as ``like`` (its param) when given."""
    return is_dense(t) if like is None else same_flat_layout(t, like)


def _as_kernel_input(t: Tensor, like: Tensor | None = None) -> Tensor:
    """``t`` (a checked grad: ``_args.check_grad``) dense and laid out as ``like`` (the param).

    A channels_last grad of a channels_last param is used as it
    is; only a grad whose strides differ from its param's is copied, into the param's strides.
    """
    if _laid_out(t, like):
        return t
    if like is None:
        return t.contiguous()
    return torch.empty_like(like, dtype=t.dtype).copy_(t.view(like.shape) if t.is_contiguous() else t.reshape(like.shape))


def _per_plan(scratch, name: str, batch, build):
    """``build()``, kept in the caller's memo while the caller passes the same Scratch with the same
    ``batch.params`` list, whose identity stands for all of the batch's lists: that promises the
    tensors behind them unchanged but for the grads' addresses ([note: scratch] in functional.py),
    so the per-tensor work of a step runs once per plan. Without a Scratch, every call builds."""
    if scratch is None:
        return build()
    entry = scratch.memo.get(name)
    if entry is None or entry[0] is not batch.params:
        entry = scratch.memo[name] = (batch.params, build())
    return entry[1]


def _kernel_grads(batch, params, scratch, name: str) -> list:
    """``batch.grads`` as the op reads them: each grad itself, or a copy laid out as its param
    (``params``; dense where None) where its memory differs. Which grads need a copy is found once
    per plan (:func:`_per_plan`: a plan's fresh grads keep the checked layouts), so a step that needs
    none makes no Python call per tensor."""
    grads = batch.grads
    likes = params if params is not None else [None] * len(grads)
    copies = _per_plan(scratch, name, batch,
                       lambda: [i for i, (g, like) in enumerate(zip(grads, likes)) if not _laid_out(g, like)])
    if not copies:
        return grads
    kernel_grads = list(grads)
    for i in copies:
        kernel_grads[i] = _as_kernel_input(grads[i], likes[i])
    return kernel_grads


def copy_back_unscaled(grads, kernel_grads) -> None:
    """Where the kernel wrote the unscaled gradient into a re-laid-out copy, the caller's grad gets it
    (rare: a grad whose strides differ from its param's; the optimizer hands over matching ones)."""
    for g, k in zip(grads, kernel_grads):
        if k is not g:
            g.copy_(k.view(g.shape) if k.is_contiguous() and g.is_contiguous() else k.reshape(g.shape))


# The compact encodings (DESIGN §9) each device's update kernel serves natively; the others go to
# the reference passes inside the same step (functional.run_step).
COMPACT_MODES = {"cpu": frozenset({"split16", "split8", "bf16", "int8", "int4", "sr"}),
                 "cuda": frozenset({"split16", "split8", "bf16", "int8", "int4", "sr"})}


class CompiledBackend:
    """The four passes of ``_backends.Backend`` (accumulate, stats, update, scaler update) over ``torch.ops.ampfused`` for one device type."""

    def __init__(self, name: str, module):
        self.NAME = name
        self.COMPACT_MODES = COMPACT_MODES.get(name, frozenset())
        self.module = module
        self.cpu_isa = getattr(module, "CPU_ISA", "?")
        self._empties: dict[torch.device, Tensor] = {}

    def __repr__(self) -> str:
        return f"<ampfused compiled backend {self.NAME!r} (ampfused._C, CPU ISA {self.cpu_isa})>"

    def supports(self, device: torch.device) -> str | None:
        if device.type != self.NAME:
            return f"the {self.NAME} kernels of ampfused._C do not serve {device.type} tensors"
        return None

    def accumulate_(self, main_grad: Tensor, grad: Tensor) -> None:
        if main_grad.dtype != torch.float32 or not main_grad.is_contiguous() or grad.device != main_grad.device:
            main_grad.add_(grad)  # not a layout the kernel takes: the reference way
            return
        torch.ops.ampfused.accumulate(main_grad, _as_kernel_input(grad, main_grad))

    def grad_stats_(self, batch, grad_scale: Tensor | None, found_inf: Tensor | None,
                    max_grad_norm: float | None, stats: Tensor, scratch=None, *, check_nonfinite: bool = True) -> None:
        torch.ops.ampfused.grad_stats(_kernel_grads(batch, None, scratch, "compiled stats grads"), grad_scale, found_inf,
                                      None if max_grad_norm is None else float(max_grad_norm), stats,
                                      self._scratch_buffer(scratch, stats.device), check_nonfinite)

    def adamw_update_(self, batch, stats: Tensor, *, scratch=None, grad_scale: Tensor | None = None,
                      rounding_seed: int | None = None) -> None:
        if not batch.params:
            return
        groups = batch.groups
        # The op takes the batch as parallel per-field lists: a TORCH_LIBRARY schema types its arguments
        # as Tensor[] / float[] / int[] / Tensor?[], not records, so the group rows become one list per
        # field here (per group, never per tensor) and csrc/ops.cpp packs them into UpdateGroup records.
        # [note: lr kinds] in _batch.py: an LR_VALUE lr goes as a float (a tensor in host memory is read
        # here, no sync), any other tensor lr as it is, read on its device. The op gets no kind list: its
        # schema takes the Tensor, whose dtype is its kind (csrc/contract_aten_generated.h lr_kind_of), and
        # the op, callable directly, checks its tensor itself; it also makes, and keeps alive for CUDA
        # graphs, the float32 copy an lr on another device or of another dtype needs.
        lrs = [float(h.lr) if kind == LR_VALUE else 0.0 for h, kind in zip(groups, batch.lr_kinds)]
        lr_tensors = [None if kind == LR_VALUE else h.lr.detach() for h, kind in zip(groups, batch.lr_kinds)]
        params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, group_ids, flat_scales, index, bases = \
            _per_plan(scratch, "compiled update lists", batch, lambda: self._tensor_lists(batch))
        kernel_grads = _kernel_grads(batch, params, scratch, "compiled update grads")
        torch.ops.ampfused.adamw_update(
            params, kernel_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, group_ids, lrs, lr_tensors,
            [h.beta1 for h in groups], [h.beta2 for h in groups], [h.eps for h in groups],
            [h.weight_decay for h in groups], [h.flags for h in groups], stats,
            self._scratch_buffer(scratch, stats.device), grad_scale, None if rounding_seed is None else int(rounding_seed),
            flat_scales, index, bases)
        if grad_scale is not None:
            copy_back_unscaled(batch.grads, kernel_grads)

    def _tensor_lists(self, batch) -> tuple:
        """The op's per-tensor arguments but the grads, from ``batch``'s lists (a plan's stay the same
        objects, so this runs once per plan: :func:`_per_plan`). An empty tensor stands for None in the
        op's mutable lists (see csrc/ops.cpp); compact state travels in the dtypes of masters and
        moments, int8 codes with their block scales, three per tensor, where the kernels serve them."""
        params, moment_scales = batch.params, batch.moment_scales
        none = self._empty(params[0].device)
        flat_scales = None
        if moment_scales is not None and any(s is not None for s in moment_scales):
            if "int8" not in self.COMPACT_MODES:
                raise NotImplementedError(f"the {self.NAME} kernels do not serve int8 moments (moment_scales given)")
            flat_scales = [none if t is None else t for s in moment_scales for t in (s if s is not None else (None,) * 3)]
        return (list(params), list(batch.exp_avgs), list(batch.exp_avg_sqs),
                [none if t is None else t for t in batch.max_exp_avg_sqs], list(batch.steps),
                [none if t is None else t for t in batch.masters], list(batch.group_ids), flat_scales,
                None if batch.index is None else [int(i) for i in batch.index],
                None if batch.element_base is None else [int(b) for b in batch.element_base])

    def scaler_update_(self, found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps, consecutive_skips, watch,
                       *, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale) -> None:
        torch.ops.ampfused.scaler_update(found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps,
                                         consecutive_skips, watch, float(growth_factor), float(backoff_factor),
                                         int(growth_interval), int(hysteresis), None if min_scale is None else float(min_scale))

    def _scratch_buffer(self, scratch, device: torch.device) -> Tensor | None:
        """The caller's launch scratch for the CUDA kernels ([note: scratch]); the CPU kernels need none."""
        return scratch.buffer(device) if scratch is not None and self.NAME == "cuda" else None

    def _empty(self, device: torch.device) -> Tensor:
        empty = self._empties.get(device)
        if empty is None:
            empty = self._empties[device] = torch.empty(0, dtype=torch.float32, device=device)
        return empty
