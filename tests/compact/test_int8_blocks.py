"""int8 moments (256-element blocks, one fp32 scale each) on every backend's update: blocks cut by a
tensor's end, tensors under one block, two scale blocks per program block, and a NaN block."""
import math

import pytest
import torch

from ampfused import _compact as C
from helpers import check_step, compact_entry

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def test_int8_blocks_smaller_than_a_block_and_ragged_tails(kernel):
    """int8 states of tensors under one block, one block plus a bit, and a work unit plus a partial
    block (the optimizer keeps tensors under SMALL_TENSOR_NUMEL fp32, but the kernels serve any size),
    each held bitwise to its twin over two steps."""
    entries = []
    # (the emulation's chunks of 65536 are crossed by test_two_work_units_of_int8_state)
    for i, n in enumerate((1, 100, 257, (4096 if kernel.name == "cuda-emulated" else kernel.unit) + 31)):
        gen = torch.Generator().manual_seed(80 + i)
        master = torch.randn(n, generator=gen) * 0.5
        param = master.to(torch.bfloat16)
        state = {"step": torch.tensor(2.0)}
        state["master_residual8"] = C.split8(master, torch.bfloat16)[1]
        for key, kind in (("exp_avg", "signed"), ("exp_avg_sq", "sqrt"), ("max_exp_avg_sq", "sqrt")):
            value = torch.randn(n, generator=gen) * 1e-2 if kind == "signed" else torch.rand(n, generator=gen) * 1e-4
            state[key + "_codes"], state[key + "_scales"] = C.quantize(value, kind)
        grad = torch.randn(n, generator=torch.Generator().manual_seed(100 + i)) * 1e-2
        entries.append((param.to(kernel.device), grad.to(kernel.device), {k: t.to(kernel.device) for k, t in state.items()}))
    for _ in range(2):
        check_step(kernel, entries, [("split8", "int8")] * len(entries), amsgrad=True, factor=0.5, against_spec=False)


def test_int8_blocks_of_two_scale_blocks(kernel, monkeypatch):
    """The GPU Triton block of 512 elements: a [2, 256] tile, two scales per block (the interpreter's
    default block holds one); the other backends step the same tensors as ever."""
    if kernel.name == "triton":
        from ampfused.kernels import _runtime

        monkeypatch.setattr(_runtime, "UPDATE_BLOCK", 512)
    large = C.SMALL_TENSOR_NUMEL + 300
    entries = [kernel.entry(large, torch.bfloat16, "split16", "int8", amsgrad=True),
               kernel.entry(large + 700, torch.float32, "fp32", "int8", amsgrad=True, seed=1)]
    check_step(kernel, entries, [("split16", "int8"), ("fp32", "int8")], amsgrad=True)


def test_int8_scales_are_block_maxima_and_nan_blocks_stay_nan(kernel):
    """A block whose new moment is NaN (skip_nonfinite=False lets a NaN grad through) gets a NaN
    scale and decodes to NaN, as the specification's amax; the other blocks are untouched by it."""
    entry = compact_entry(4096 + 300, torch.float32, "fp32", "int8", kernel.device, seed=4)
    entry[1].view(-1)[300] = math.nan  # block 1
    entry[1].view(-1)[800] = -math.nan  # block 3: a NaN with its sign bit set
    kernel.step([entry])
    scales = entry[2]["exp_avg_scales"].reshape(-1)
    nan_blocks = torch.zeros(scales.numel(), dtype=torch.bool, device=scales.device)
    nan_blocks[[1, 3]] = True
    assert torch.isnan(scales[nan_blocks]).all() and torch.isfinite(scales[~nan_blocks]).all()
    decoded = C.decode_state(entry[2])["exp_avg"].reshape(-1)
    assert torch.isnan(decoded[256:512]).all() and torch.isnan(decoded[768:1024]).all()
    assert torch.isfinite(decoded[:256]).all() and torch.isfinite(decoded[512:768]).all()
