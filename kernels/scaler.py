"""GradScaler.update in one launch of one program (``ampfused.reference.scaler_update_`` is the spec).

[note: explicit finiteness] torch grows the scale only to a finite value; that is tested as
``grown == grown and |grown| != inf``, not as ``grown - grown == 0``, which fp fusion turns into
``fma(scale, growth_factor, -grown)`` (the product's rounding error: growth stops after the first
inexact product). Fusion is off as well: this kernel has nothing to fuse, and a scale must be
``RN(scale * factor)`` as in torch.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from . import _runtime
from .adamw import _split_f64 as split_f64


@triton.jit
def _scaler_update_kernel(found_inf_ptr, scale_ptr, growth_ptr, hysteresis_ptr, skipped_ptr, consecutive_ptr, watch_ptr,
                          growth_hi, growth_mid, growth_lo, backoff_hi, backoff_mid, backoff_lo, min_scale,
                          growth_interval, hysteresis, HAS_MIN_SCALE: tl.constexpr):
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
    # torch multiplies in double and rounds once; the fp64 factors arrive as three exact fp32 parts
    # (tl.cast, not .to: the interpreter passes a 0.0 part as a plain Python float)
    growth_factor = tl.cast(growth_hi, tl.float64) + tl.cast(growth_mid, tl.float64) + tl.cast(growth_lo, tl.float64)
    backoff_factor = tl.cast(backoff_hi, tl.float64) + tl.cast(backoff_mid, tl.float64) + tl.cast(backoff_lo, tl.float64)
    grown = (scale.to(tl.float64) * growth_factor).to(tl.float32)
    backed_off = (scale.to(tl.float64) * backoff_factor).to(tl.float32)
    if HAS_MIN_SCALE:
        backed_off = tl.where(backed_off < min_scale, min_scale, backed_off)  # NaN stays NaN, as clamp
    grown_finite = (grown == grown) & (tl.abs(grown) != float("inf"))
    new_scale = tl.where(back_off, backed_off, tl.where(grow & grown_finite, grown, scale))
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
    _runtime.launch(_scaler_update_kernel, (1,))(
        found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps, consecutive_skips, watch,
        *split_f64(float(growth_factor)), *split_f64(float(backoff_factor)), float(min_scale or 0.0),
        int(growth_interval), int(hysteresis),
        HAS_MIN_SCALE=min_scale is not None, num_warps=1, enable_fp_fusion=False)
