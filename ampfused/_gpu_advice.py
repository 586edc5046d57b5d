"""What `info`, `check` and the bench say about the GPU backends on a machine without a GPU.

There the ``cuda`` and ``triton`` backends cannot serve and nothing is broken, so these lines say
that plainly, with the install command for a machine that has a GPU, instead of passing on the
probe's reasons: those diagnose a GPU machine whose install lacks something ("install a CUDA build
of torch, then reinstall ampfused") and are still shown wherever a GPU is present. Asked when a
command runs, never at ``import ampfused``.
"""
from __future__ import annotations

import glob

import torch

GPU_BACKENDS = ("cuda", "triton")

GPU_INSTALL = ("a CUDA build of torch (`pip install torch==2.13.0`: PyPI's default Linux wheel is one, and brings "
               "Triton), then ampfused's install again to build its CUDA kernels: `pip install --no-build-isolation "
               "-e . --config-settings editable_mode=strict` in the checkout (AMPFUSED_BUILD_CUDA=1 makes a missing "
               "nvcc an error)")

INTERPRETER = ("TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors through Triton's interpreter, "
               "for testing only: far too slow to benchmark")

# Device files a GPU driver creates: NVIDIA's, and AMD's compute interface (ROCm, which Triton serves)
_GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")


def machine_has_gpu() -> bool:
    """Whether this machine has a GPU, seen by torch or not (a CPU-only torch sees none on a GPU machine)."""
    return torch.cuda.is_available() or any(glob.glob(pattern) for pattern in _GPU_DEVICE_FILES)


def no_gpu_reason(name: str) -> str:
    """The line for GPU backend ``name`` on a machine without a GPU."""
    if name == "triton":
        return f"needs a GPU, and this machine has none; {INTERPRETER}"
    return "needs an NVIDIA GPU, and this machine has none"


def no_gpu_note() -> str:
    """One paragraph: what serves this machine, and what to install on a machine with a GPU."""
    return ("This machine has no GPU: the cpu and reference backends serve it, and nothing needs fixing. "
            f"The cuda and triton backends need a GPU; on a machine with one, install {GPU_INSTALL}.")
