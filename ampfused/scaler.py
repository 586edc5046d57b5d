"""GradScaler: torch.amp.GradScaler that lets FusedAmpAdamW find overflows in its own stats pass,
unscales fp16 and bf16 gradients, and updates the scale on the device with hysteresis and a floor."""
from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from .optim import FusedAmpAdamW
from . import _backends
from ._amp import unscale_and_check_


class LossScaleCollapseWarning(RuntimeWarning):
    """Many consecutive steps were skipped for inf/NaN gradients: training is not progressing."""


class LossScaleCollapseError(RuntimeError):
    """Raised instead of :class:`LossScaleCollapseWarning` with ``raise_on_collapse=True``."""


class GradScaler(torch.amp.GradScaler):
    r"""Drop-in :class:`torch.amp.GradScaler` for :class:`ampfused.FusedAmpAdamW`.

    Differences from torch's scaler:

    * with a :class:`FusedAmpAdamW`, ``step()`` runs no inf-check pass of its own: the optimizer's
      stats pass, which it runs anyway for the gradient norm, finds inf/NaN and reports it back on
      the device. With any other optimizer it behaves exactly like torch's.
    * ``unscale_`` accepts fp16 and bf16 gradients (and ``p.main_grad``).
    * ``update()`` implements, on the device,

      .. math::
          \begin{aligned}
            &\textbf{if } \text{found\_inf}: \; g \leftarrow 0;\; h \leftarrow h - 1;\;
               \textbf{if } h \le 0: S \leftarrow \max(S \cdot \text{backoff\_factor}, \text{min\_scale}) \\
            &\textbf{else}: \; g \leftarrow g + 1;\; \textbf{if } g = \text{growth\_interval}:
               g \leftarrow 0;\; h \leftarrow \text{hysteresis};\;
               S \leftarrow S \cdot \text{growth\_factor} \text{ (if finite)}
          \end{aligned}

      ``hysteresis=1`` and ``min_scale=None`` give exactly torch's scale trajectory. As in Megatron-LM
      and DeepSpeed, the hysteresis budget ``h`` is restored when the scale grows.
    * loss-scale collapse is never silent: ``update()`` counts consecutive skipped steps on the
      device, and once ``collapse_threshold`` steps in a row were skipped (typically the scale sits
      at ``min_scale``, or a NaN loss defeats every scale) it warns with
      :class:`LossScaleCollapseWarning`, again every ``collapse_threshold`` further skips, or raises
      :class:`LossScaleCollapseError` with ``raise_on_collapse=True``.

    [note: lazy collapse check] ``update()`` must not synchronize, so on CUDA it copies the counter
    (and the scale) to pinned host memory without blocking, records an event, and reads the copy at
    a later ``update()`` once the event has completed: the warning or error comes one or two steps
    after the threshold is crossed and reports the count it saw. On the CPU the read is free and
    immediate. Other device types read the counter every ``_SLOW_CHECK_EVERY`` updates (one sync each).

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch's.
        hysteresis (int): overflowing steps tolerated before the scale backs off (default 1).
        min_scale (float, optional): the scale never backs off below this value.
        collapse_threshold (int, optional): consecutive skipped steps that count as a collapsed
            loss scale (default 50); ``None`` turns the check off.
        raise_on_collapse (bool): raise :class:`LossScaleCollapseError` instead of warning.
    """

    _SLOW_CHECK_EVERY = 100

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: float | None = None, collapse_threshold: int | None = 50,
                 raise_on_collapse: bool = False) -> None:
        if not (isinstance(hysteresis, int) and hysteresis >= 1):
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
        if min_scale is not None and not (0 < min_scale < math.inf):
            raise ValueError(f"min_scale must be a positive finite float or None, got {min_scale!r}")
        if min_scale is not None and min_scale > init_scale:
            raise ValueError(f"min_scale ({min_scale}) is larger than init_scale ({init_scale})")
        if collapse_threshold is not None and not (isinstance(collapse_threshold, int) and collapse_threshold >= 1):
            raise ValueError(f"collapse_threshold must be an int >= 1 or None, got {collapse_threshold!r}")
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self._hysteresis = hysteresis
        self._min_scale = min_scale
        self._init_hysteresis_tracker = hysteresis
        self._init_skipped_steps = 0
        self._hysteresis_tracker: Tensor | None = None
        self._skipped_steps: Tensor | None = None
        self._collapse_threshold = collapse_threshold
        self._raise_on_collapse = bool(raise_on_collapse)
        self._init_consecutive_skips = 0
        self._consecutive_skips: Tensor | None = None
        self._reset_collapse_watch()

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._skipped_steps = torch.full((), self._init_skipped_steps, dtype=torch.int64, device=dev)
        self._consecutive_skips = torch.full((), self._init_consecutive_skips, dtype=torch.int64, device=dev)

    @property
    def skipped_steps(self) -> int:
        """Number of optimizer steps skipped because gradients were inf/NaN.

        .. warning:: Reading it synchronizes the host with the device (like ``get_scale``).
        """
        if self._skipped_steps is None:
            return self._init_skipped_steps
        return int(self._skipped_steps.item())

    @property
    def consecutive_skipped_steps(self) -> int:
        """Number of steps skipped in a row up to the last ``update()`` (0 after a good step).

        .. warning:: Reading it synchronizes the host with the device (like ``get_scale``).
        """
        if self._consecutive_skips is None:
            return self._init_consecutive_skips
        return int(self._consecutive_skips.item())

    # ------------------------------------------------------------------ unscale / step

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # torch refuses fp16 grads here and its CUDA kernel refuses
        # bf16; with fp32 master weights both are safe to unscale, so both are accepted.
        if isinstance(optimizer, FusedAmpAdamW):
            optimizer.unscale_grads_(inv_scale, found_inf)
            return {found_inf.device: found_inf}
        per_device: dict[torch.device, list[Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        if p.grad.dtype is torch.float16:
                            p.grad = p.grad.coalesce()
                        per_device.setdefault(p.grad.device, []).append(p.grad._values())
                    else:
                        per_device.setdefault(p.grad.device, []).append(p.grad)
            found = {}
            for device, grads in per_device.items():
                found[device] = found_inf.to(device, copy=True)
                unscale_and_check_(grads, inv_scale.to(device), found[device])
        return found

    def step(self, optimizer, *args, **kwargs):
        """Step ``optimizer`` unless its gradients hold inf/NaN; returns what ``optimizer.step`` returns."""
        if not (self._enabled and isinstance(optimizer, FusedAmpAdamW)):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        unscaled = optimizer_state["stage"] is OptState.UNSCALED
        optimizer.grad_scale = None if unscaled else scale
        optimizer.found_inf = sum(optimizer_state["found_inf_per_device"].values()) if unscaled else None
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        # The optimizer's flag (a view of its stats, no launch) includes any overflow unscale_ found,
        # so it replaces those entries; a step with no gradients skipped nothing.
        skipped = optimizer.step_skipped
        if skipped is None:
            skipped = torch.zeros((), dtype=torch.float32, device=scale.device)
        optimizer_state["found_inf_per_device"] = {skipped.device: skipped}
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale on the device (see the class docstring); never synchronizes.

        The rules run as the ``scaler_update_`` pass of the backend that serves
        the scale's device (one kernel on a GPU, one op on the CPU), which also writes the
        collapse watch's snapshot; the reference pass serves where a backend has none.
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if new_scale is not None:  # skipped steps count whether the rules or the user set the next scale
            if found_infs:
                found = _one_flag(found_infs, scale.device) != 0
                self._skipped_steps.add_(found.long())
                self._consecutive_skips.copy_(torch.where(found, self._consecutive_skips + 1, 0))
            super().update(new_scale)
            return
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        if self._watch_device is None or self._watch_device.device != scale.device:
            self._watch_device = torch.zeros(2, dtype=torch.float64, device=scale.device)
        _scaler_pass(scale.device).scaler_update_(
            _one_flag(found_infs, scale.device), scale, growth_tracker, self._hysteresis_tracker, self._skipped_steps,
            self._consecutive_skips, self._watch_device, growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor, growth_interval=self._growth_interval, hysteresis=self._hysteresis,
            min_scale=self._min_scale)
        self._per_optimizer_states = self._per_optimizer_states.__class__(self._per_optimizer_states.default_factory)
        self._watch_collapse(scale)

    # ------------------------------------------------------------------ collapse check

    def _reset_collapse_watch(self) -> None:
        self._watch_device: Tensor | None = None  # [count, scale] written on the device by scaler_update_
        self._watch_host: Tensor | None = None  # [count, scale] on the host (pinned on CUDA)
        self._watch_event = None  # CUDA event recorded after the copy into _watch_host
        self._watch_pending = False
        self._watch_updates = 0
        self._warned_at = 0

    def _watch_collapse(self, scale: Tensor) -> None:
        """Look at a host copy of the skip counter without blocking (see [note: lazy collapse check])."""
        if self._collapse_threshold is None:
            return
        self._watch_updates += 1
        device = scale.device
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return
            if self._watch_pending and self._watch_event.query():
                self._watch_pending = False
                self._check_collapse()
            if not self._watch_pending:
                if self._watch_host is None:
                    self._watch_host = torch.empty(2, dtype=torch.float64, pin_memory=True)
                    self._watch_event = torch.cuda.Event()
                self._watch_host.copy_(self._watch_device, non_blocking=True)  # a copy, no kernel
                self._watch_event.record()
                self._watch_pending = True
        elif device.type == "cpu" or self._watch_updates % self._SLOW_CHECK_EVERY == 0:
            self._watch_host = self._watch_device if device.type == "cpu" else self._watch_device.cpu()
            self._check_collapse()

    def _check_collapse(self) -> None:
        count, scale = self._watch_host.tolist()  # one read, not two indexing ops
        count = int(count)
        if count < self._collapse_threshold:
            self._warned_at = 0
            return
        if count - self._warned_at < self._collapse_threshold:
            return
        self._warned_at = count
        floor = "" if self._min_scale is None else f" (min_scale={self._min_scale:g}{', reached' if scale <= self._min_scale else ''})"
        message = (
            f"ampfused.GradScaler: the last {count} optimizer steps were all skipped because the gradients "
            f"held inf/NaN; the loss scale is {scale:g}{floor}. Training is not progressing: look for a NaN/inf "
            f"in the loss, inputs or weights, lower the learning rate, or lower min_scale.")
        if self._raise_on_collapse:
            raise LossScaleCollapseError(message + " (raise_on_collapse=True)")
        warnings.warn(message + " Pass raise_on_collapse=True to stop with an error instead.",
                      LossScaleCollapseWarning, stacklevel=4)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's keys plus ``hysteresis``, ``min_scale``, ``_hysteresis_tracker``, ``skipped_steps``,
        ``consecutive_skipped_steps``."""
        state = super().state_dict()
        if self._enabled:
            state.update(hysteresis=self._hysteresis, min_scale=self._min_scale,
                         _hysteresis_tracker=self._get_hysteresis_tracker(), skipped_steps=self.skipped_steps,
                         consecutive_skipped_steps=self.consecutive_skipped_steps)
        return state

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of torch.amp.GradScaler (missing keys keep their defaults)."""
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        self._init_skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._init_consecutive_skips = int(state_dict.get("consecutive_skipped_steps", 0))
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
            self._skipped_steps.fill_(self._init_skipped_steps)
            self._consecutive_skips.fill_(self._init_consecutive_skips)
        self._reset_collapse_watch()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_init_skipped_steps"] = self.skipped_steps
            state["_init_consecutive_skips"] = self.consecutive_skipped_steps
            state["_hysteresis_tracker"] = None
            state["_skipped_steps"] = None
            state["_consecutive_skips"] = None
            state.update(_watch_host=None, _watch_event=None, _watch_pending=False, _watch_device=None)  # events don't pickle
        return state


def _one_flag(found_infs: list[Tensor], device: torch.device) -> Tensor:
    """One fp32 flag on ``device``, non-zero when any of ``found_infs`` is (no op for the usual single flag)."""
    if len(found_infs) == 1:
        f = found_infs[0]
        if f.device == device and f.dtype == torch.float32 and f.numel() == 1:
            return f
    return torch.stack([f.to(device=device, dtype=torch.float32, non_blocking=True).reshape(()) for f in found_infs]).sum()


_scaler_passes: dict[tuple, Any] = {}


def _scaler_pass(device: torch.device):
    """The backend whose ``scaler_update_`` serves ``device`` (the reference where none has one)."""
    key = (device, os.environ.get(_backends.ENV_VAR))
    backend = _scaler_passes.get(key)
    if backend is None:
        try:
            backend = _backends.resolve(None, device)[0]
        except RuntimeError:
            backend = None
        if backend is None or not hasattr(backend, "scaler_update_"):
            backend = _backends.probe("reference")[0]
        backend = _scaler_passes[key] = backend
    return backend
