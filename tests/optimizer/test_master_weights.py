"""fp16/bf16 params: fp32 master weights and fp32 gradient accumulation (DESIGN §2.5, §3)."""
import pytest
import torch

import ampfused
from helpers import mlp, tol

MICRO_BATCHES = 4
STEPS = 6


WIDTHS = (24, 40, 7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accumulated_master_training_matches_fp32_reference(backend, device, dtype):
    """N micro-batches + one step == AdamW on fp32 masters with the same grads summed in fp32."""
    model = mlp(*WIDTHS, activation=torch.nn.GELU, dtype=dtype, device=device)
    params = list(model.parameters())
    captured = {p: [] for p in params}
    for p in params:  # a tensor hook sees each fresh low-precision grad before it is accumulated
        p.register_hook(lambda g, p=p: captured[p].append(g.clone()))
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend)
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(masters, lr=1e-2)
    for step in range(STEPS):
        for mb in range(MICRO_BATCHES):
            g = torch.Generator().manual_seed(step * 10 + mb)
            x = torch.randn(5, 24, generator=g).to(device=device, dtype=dtype)
            model(x).float().pow(2).mean().backward()
            assert all(p.grad is p.main_grad and p.grad.dtype == torch.float32 for p in params), \
                "after every backward p.grad must be the fp32 main_grad"
        for p, m in zip(params, masters):
            assert len(captured[p]) == MICRO_BATCHES and captured[p][0].dtype == dtype
            m.grad = captured[p][0].float()
            for g in captured[p][1:]:
                m.grad += g.float()  # fp32 accumulation, in micro-batch order
            torch.testing.assert_close(p.grad, m.grad, rtol=0, atol=0)
            captured[p].clear()
        opt.step()
        ref.step()
        opt.zero_grad()
        assert all(p.grad is None for p in params), "zero_grad() clears p.grad as torch does"
    for p, m in zip(params, masters):
        state = opt.state[p]
        assert state["master_param"].dtype == torch.float32
        torch.testing.assert_close(state["master_param"], m.detach(), **tol(backend))
        torch.testing.assert_close(state["exp_avg"], ref.state[m]["exp_avg"], **tol(backend))
        torch.testing.assert_close(state["exp_avg_sq"], ref.state[m]["exp_avg_sq"], **tol(backend))
        # the param is exactly the round-to-nearest-even of its master
        assert torch.equal(p.detach(), state["master_param"].to(dtype))


def test_main_grad_is_a_view_of_flat_storage(device):
    model = mlp(*WIDTHS, activation=torch.nn.GELU, dtype=torch.bfloat16, device=device)
    opt = ampfused.FusedAmpAdamW(model.parameters())
    storages = {p.main_grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1 and all(p.main_grad.dtype == torch.float32 for p in model.parameters())
    assert all(p.main_grad.data_ptr() % 128 == 0 for p in model.parameters())
    assert opt.main_grads.flat is not None


def test_flags_off_read_low_precision_grads_directly(backend, device):
    model = mlp(*WIDTHS, activation=torch.nn.GELU, dtype=torch.bfloat16, device=device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend, fp32_grad_accumulation=False)
    model(torch.randn(3, 24, device=device, dtype=torch.bfloat16)).float().sum().backward()
    assert all(p.grad is not None and not hasattr(p, "main_grad") for p in model.parameters())
    opt.step()
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in model.parameters())


def test_no_master_weights_updates_low_precision_params_in_fp32_math(backend, device):
    p = torch.nn.Parameter(torch.randn(300, device=device).to(torch.bfloat16))
    q = p.detach().float().clone().requires_grad_()
    opt = ampfused.FusedAmpAdamW([p], lr=1e-2, master_weights=False, backend=backend)
    assert not hasattr(p, "main_grad"), "accumulation follows master weights by default"
    g = torch.randn(300, device=device).to(torch.bfloat16)
    p.grad, q.grad = g.clone(), g.float()
    opt.step()
    ref = torch.optim.AdamW([q], lr=1e-2)
    ref.step()
    assert "master_param" not in opt.state[p]
    assert torch.equal(p.detach(), q.detach().to(torch.bfloat16))


def test_fp32_params_are_their_own_master(backend, device):
    model = torch.nn.Linear(4, 4).to(device)
    with pytest.warns(ampfused.UnusedOptionWarning, match="fp32_grad_accumulation=True has no effect"):
        opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend, master_weights=True, fp32_grad_accumulation=True)
    model(torch.randn(2, 4, device=device)).sum().backward()
    opt.step()
    assert all("master_param" not in opt.state[p] and not hasattr(p, "main_grad") for p in model.parameters())


def test_mixed_dtypes_in_one_optimizer(backend, device):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device).to(dt)) for n, dt in
              [(97, torch.float32), (1025, torch.bfloat16), (33, torch.float16), (1, torch.bfloat16)]]
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend)
    ref_masters = [p.detach().float().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(ref_masters, lr=1e-2)
    for step in range(5):
        for p, m in zip(params, ref_masters):
            g = torch.randn(p.shape, device=device).to(p.dtype)
            p.grad, m.grad = g.clone(), g.float()
        opt.step()
        ref.step()
        opt.zero_grad()
    for p, m in zip(params, ref_masters):
        master = opt.state[p].get("master_param", p)
        torch.testing.assert_close(master.detach().float(), m.detach(), **tol(backend))
        assert torch.equal(p.detach(), master.detach().to(p.dtype))


def test_add_param_group_after_steps_keeps_state(backend, device):
    a = torch.nn.Parameter(torch.randn(50, device=device).to(torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(20, device=device).to(torch.bfloat16))
    opt = ampfused.FusedAmpAdamW([a], backend=backend)
    a.grad = torch.ones_like(a)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[a].items()}
    # no zero_grad: the accumulated main_grad (all ones) must survive the re-layout
    opt.add_param_group({"params": [b], "lr": 0.1})
    assert hasattr(b, "main_grad")
    torch.testing.assert_close(a.main_grad, torch.ones_like(a.main_grad), rtol=0, atol=0)
    opt.zero_grad()
    for k, v in before.items():
        torch.testing.assert_close(opt.state[a][k], v, rtol=0, atol=0)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert opt.state[a]["step"].item() == 2 and opt.state[b]["step"].item() == 1


def test_frozen_low_precision_params_get_no_hook(backend, device):
    frozen = torch.nn.Parameter(torch.ones(3, device=device, dtype=torch.bfloat16), requires_grad=False)
    live = torch.nn.Parameter(torch.ones(3, device=device, dtype=torch.bfloat16))
    opt = ampfused.FusedAmpAdamW([frozen, live], backend=backend)
    assert not hasattr(frozen, "main_grad") and hasattr(live, "main_grad")
    (live.float() * 2).sum().backward()
    opt.step()
    assert frozen.equal(torch.ones_like(frozen)) and not opt.state[frozen]
    assert opt.state[live]["step"].item() == 1
