"""GradScaler.update in one launch of one program (``ampfused.reference.scaler_update_`` is the spec)."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from . import _runtime


@triton.jit
def _scaler_update_kernel(found_inf_ptr, scale_ptr, growth_ptr, hysteresis_ptr, skipped_ptr, consecutive_ptr, watch_ptr,
                          growth_factor, backoff_factor, min_scale, growth_interval, hysteresis,
                          HAS_MIN_SCALE: tl.constexpr):
    found = tl.load(found_inf_ptr) != 0.0
    tl.store(skipped_ptr, tl.load(skipped_ptr) + tl.where(found, 1, 0).to(tl.int64))
    consecutive = tl.where(found, tl.load(consecutive_ptr) + 1, 0).to(tl.int64)
    tl.store(consecutive_ptr, consecutive)
    tracker = tl.load(hysteresis_ptr)
    hysteresis_left = tl.where(found, tracker - 1, tracker)
    back_off = found & (hysteresis_left <= 0)
    good_steps = tl.where(found, 0, tl.load(growth_ptr) + 1)
    grow = good_steps == growth_interval
    scale = tl.load(scale_ptr)
    grown = scale * growth_factor
    backed_off = scale * backoff_factor
    if HAS_MIN_SCALE:
        backed_off = tl.where(backed_off < min_scale, min_scale, backed_off)  # NaN stays NaN, as clamp
    new_scale = tl.where(back_off, backed_off, tl.where(grow & (grown - grown == 0.0), grown, scale))
    tl.store(scale_ptr, new_scale)
    tl.store(growth_ptr, tl.where(grow, 0, good_steps).to(tl.int32))
    tl.store(hysteresis_ptr, tl.where(grow, hysteresis, hysteresis_left).to(tl.int32))
    tl.store(watch_ptr, consecutive.to(tl.float64))
    tl.store(watch_ptr + 1, new_scale.to(tl.float64))


@_runtime.launches_on(lambda found_inf, scale, *args, **kwargs: scale.device)
def scaler_update_(found_inf: Tensor, scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                   skipped_steps: Tensor, consecutive_skips: Tensor, watch: Tensor, *, growth_factor: float,
                   backoff_factor: float, growth_interval: int, hysteresis: int, min_scale: float | None) -> None:
    """One GradScaler.update on the device, one launch; see ``ampfused._backends``."""
    _scaler_update_kernel[(1,)](
        found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps, consecutive_skips, watch,
        float(growth_factor), float(backoff_factor), float(min_scale or 0.0), int(growth_interval), int(hysteresis),
        HAS_MIN_SCALE=min_scale is not None, num_warps=1)
