"""What the scaler, ampfused.distributed and the benchmarks read from the optimizer: documented
public members, each checked against what it promises."""
import math

import torch

import ampfused
from ampfused import _compiled
from ampfused._reducers import MeshReducer


def bf16_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(device, torch.bfloat16)


def bf16_backward(model, device, poison=False):
    loss = model(torch.randn(4, 8, device=device, dtype=torch.bfloat16)).float().square().sum()
    loss.backward()
    if poison:
        next(iter(model.parameters())).grad.view(-1)[0] = math.nan


def test_step_skipped_is_the_last_steps_device_flag(backend, device):
    model = bf16_model(device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
    assert opt.step_skipped is None
    bf16_backward(model, device)
    opt.step()
    assert opt.step_skipped.device.type == torch.device(device).type and opt.step_skipped.item() == 0.0
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    bf16_backward(model, device, poison=True)
    opt.step()
    assert opt.step_skipped.item() == 1.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "a skipped step changes nothing"


def test_unscale_grads_scales_what_the_step_reads_and_flags_inf(backend, device):
    model = bf16_model(device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    bf16_backward(model, device)
    grads = [p.grad.clone() for p in model.parameters()]
    found_inf = torch.zeros(1, device=device)
    opt.unscale_grads_(torch.full((1,), 0.25, device=device), found_inf)
    assert found_inf.item() == 0.0
    for p, g in zip(model.parameters(), grads):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, g * 0.25)
    next(iter(model.parameters())).grad.view(-1)[0] = math.inf
    opt.unscale_grads_(torch.ones(1, device=device), found_inf)
    assert found_inf.item() == 1.0


def test_main_grads_is_the_fp32_storage_p_grad_points_into(device):
    model = bf16_model(device)
    opt = ampfused.FusedAmpAdamW(model.parameters())
    storage = opt.main_grads
    assert [id(p) for p in storage.params] == [id(p) for p in model.parameters()]
    bf16_backward(model, device)
    for p, view in zip(storage.params, storage.flat.views):
        assert p.grad is view and view.dtype == torch.float32
        assert view.untyped_storage().data_ptr() == storage.flat.data.untyped_storage().data_ptr()
    # CPU params get the C++ accumulation hook where ampfused._C is built; CUDA ones never
    hooked = torch.device(device).type == "cpu" and _compiled.load()[0] is not None
    assert [storage.has_cpu_hook(p) for p in storage.params] == [hooked] * len(storage.params)
    reducer = object()
    storage.attach_reducer(reducer)
    assert storage.reducer is reducer


def test_partition_group_gives_a_reducer_over_that_group(device):
    group = object()  # a stand-in: nothing is reduced before a step
    opt = ampfused.FusedAmpAdamW([torch.nn.Parameter(torch.zeros(3, device=device))], partition_group=group)
    assert isinstance(opt._partition_reducer, MeshReducer) and opt._partition_reducer.groups == [group]
    assert ampfused.FusedAmpAdamW([torch.nn.Parameter(torch.zeros(3, device=device))])._partition_reducer is None
