"""Where the Triton kernels can run, and the launch sizes they use there.

With ``TRITON_INTERPRET=1`` (set before this module is imported: Triton reads it
when the kernels are decorated) every kernel runs in Triton's numpy interpreter on CPU tensors.
That is how CI checks the kernels on machines without a GPU. The interpreter cannot serve CUDA
tensors for these kernels: it copies the tensors it is *passed* to the host, but the kernels reach
most tensors through int64 pointer tables, which would then point at device memory.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

NAME = "triton"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")

_launching = True  # False inside host_only()


@contextlib.contextmanager
def host_only():
    """Inside it, every pass of this backend does its host side (plan checks, pointer tables, uploads)
    and launches nothing, so nothing is updated: the time of a step is its host time alone, as on a
    GPU, where launches are asynchronous. For measuring host time where the kernels would run in the
    interpreter (``python -m ampfused bench``'s host sweep on a CPU); not for training."""
    global _launching
    saved, _launching = _launching, False
    try:
        yield
    finally:
        _launching = saved


def launch(kernel, grid):
    """``kernel[grid]``, or a call that does nothing inside :func:`host_only`."""
    return kernel[grid] if _launching else _no_launch


def _no_launch(*args, **kwargs) -> None:
    return None

# On a GPU a program moves BLOCK elements per loop iteration (4 warps, 8
# elements a thread: two 16-byte vectors of fp32) and owns one CHUNK of one tensor, so a 1B-param
# model is ~120k programs and a tensor of 10 elements is one. The interpreter pays per operation,
# not per element, yet small sizes there make the test tensors cross block and chunk boundaries.
# [note: update block] The update moves UPDATE_BLOCK = 512 elements per iteration: 4 a thread, one
# 16-byte fp32 vector per tensor; a larger block costs registers, and so blocks per SM. UPDATE_MAXNREG
# is the lowest cap at which ptxas spills nothing in the streaming loop (tests/contract/sm90_compile.py
# refuses such spills). The stats loop already has two 16-byte loads in flight a thread for fp32
# grads, so BLOCK stays 1024. The sizes and caps tried: docs/results/triton-launch-sizes.md; what
# the chosen ones compile to: docs/results/sm90-kernels.md.
if INTERPRET:
    BLOCK, UPDATE_BLOCK, CHUNK, TABLE_BLOCK, ACCUMULATE_BLOCK = 256, 256, 1024, 128, 1024
else:
    BLOCK, UPDATE_BLOCK, CHUNK, TABLE_BLOCK, ACCUMULATE_BLOCK = 1024, 512, 8192, 1024, 2048
NUM_WARPS = 4
UPDATE_MAXNREG = None if INTERPRET else 72
# Every update variant, compact ones included, fits UPDATE_MAXNREG without a spill in its block
# loops (docs/results/sm90-kernels.md; tests/contract/sm90_compile.py checks it).
# The stats launch has at most PROGRAMS_PER_SM programs per SM, each looping
# over chunks, so the last program's final reduction adds ~1000 partials (one vector load), not one
# per chunk (~820k at 7B). The interpreter gets a few programs, so the loop is still exercised.
PROGRAMS_PER_SM = 6  # fewer than the stats kernel's blocks that fit an SM (docs/results/sm90-kernels.md)
INTERPRET_PROGRAMS = 3
_sm_counts: dict[int, int] = {}


def persistent_grid(n_chunks: int, device) -> int:
    """Programs of a launch that loops over ``n_chunks`` chunks on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        return max(1, min(n_chunks, INTERPRET_PROGRAMS))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(n_chunks, _sm_counts[index] * PROGRAMS_PER_SM, TABLE_BLOCK))

_cuda_reason: dict[int, str | None] = {}


def supports(device) -> str | None:
    """None when the Triton kernels can serve tensors on ``device``, else why not."""
    device = torch.device(device)
    if device.type == "cpu":
        if INTERPRET:
            return None
        return "Triton runs on CPU tensors only under TRITON_INTERPRET=1 (set before ampfused.kernels is imported)"
    if device.type != "cuda":
        return f"the Triton kernels serve CUDA tensors, not {device.type}"
    if INTERPRET:
        return "TRITON_INTERPRET=1 is set: the interpreter cannot follow the kernels' device pointer tables; unset it to use the GPU"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_reason:
        _cuda_reason[index] = _probe_cuda()
    return _cuda_reason[index]


def _probe_cuda() -> str | None:
    try:
        import triton

        target = triton.runtime.driver.active.get_current_target()
    except Exception as exc:  # no driver, broken install, ...
        return f"Triton found no usable GPU driver ({type(exc).__name__}: {exc})"
    if target.backend not in ("cuda", "hip"):
        return f"Triton targets {target.backend!r}, not a CUDA/HIP GPU"
    return None


def launches_on(device_of):
    """Decorator of a pass: run it with its tensors' CUDA device current.

    Triton launches on ``torch.cuda.current_device()`` and its current
    stream, while the tables are uploaded on the tensors' device: an optimizer on ``cuda:1`` with
    ``cuda:0`` current would otherwise launch in the wrong context, unordered with its own grads.
    """

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            device = device_of(*args, **kwargs)
            if device.type != "cuda":
                return fn(*args, **kwargs)
            with torch.cuda.device(device):  # a no-op when it is current already; never synchronizes
                return fn(*args, **kwargs)

        return run

    return wrap
