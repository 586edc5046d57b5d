"""Drop-in behaviours a torch.optim.AdamW user relies on, around fp32 main_grad accumulation."""
import gc
import math

import pytest
import torch

import ampfused
from helpers import mlp, tol


def lp_model(device, seed=0):
    return mlp(6, 9, 3, dtype=torch.bfloat16, device=device, seed=seed)


def batch(step, device):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g).to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("clear", ["opt.zero_grad", "model.zero_grad", "grad=None"])
def test_every_way_of_clearing_grads_gives_the_same_training(backend, device, clear):
    """HF Trainer and Lightning clear with model.zero_grad(): main_grad must not pile up across steps."""
    results = []
    for how in ("opt.zero_grad", clear):
        model = lp_model(device)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
        for step in range(4):
            for micro in range(2):
                model(batch(step * 2 + micro, device)).float().sum().backward()
            opt.step()
            if how == "opt.zero_grad":
                opt.zero_grad()
            elif how == "model.zero_grad":
                model.zero_grad()
            else:
                for p in model.parameters():
                    p.grad = None
        results.append([opt.state[p]["master_param"].clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_param_without_new_grad_is_not_stepped_again(backend, device):
    model = lp_model(device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    model(batch(0, device)).float().sum().backward()
    opt.step()
    model.zero_grad()
    # only the last layer gets a gradient now
    (model[2].weight.float().sum()).backward()
    opt.step()
    assert opt.state[model[0].weight]["step"].item() == 1 and opt.state[model[2].weight]["step"].item() == 2


def test_zero_grad_without_set_to_none_keeps_params_in_the_step(backend, device):
    model = lp_model(device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    model(batch(0, device)).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # torch: zero grads, params still stepped (weight decay, moment decay)
    opt.step()
    assert all(opt.state[p]["step"].item() == 2 for p in model.parameters())


def test_a_new_optimizer_takes_the_params_over(backend, device):
    model = lp_model(device)
    old = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    scheduler = torch.optim.lr_scheduler.StepLR(old, 1)  # keeps the old optimizer alive
    old_views = [p.main_grad for p in model.parameters()]
    new = ampfused.FusedAmpAdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}], backend=backend)
    for _ in range(2):
        model(batch(0, device)).float().sum().backward()
    for p, old_view in zip(model.parameters(), old_views):
        assert p.grad is p.main_grad and p.main_grad.data_ptr() != old_view.data_ptr(), "the newest optimizer owns main_grad"
        assert p.grad.abs().sum() > 0 and not old_view.any(), "the old optimizer's hooks must do nothing"
    new.step()
    assert all(new.state[p]["step"].item() == 1 for p in model.parameters())
    del scheduler


def test_a_gradient_accumulated_before_the_optimizer_keeps_accumulating_in_fp32(backend, device):
    model = lp_model(device)
    expected = lp_model(device)
    for m in (model, expected):
        m(batch(0, device)).float().sum().backward()  # bf16 p.grad: no optimizer yet
    fp32_sum = [p.grad.float() for p in expected.parameters()]
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    model(batch(1, device)).float().sum().backward()
    expected.zero_grad()
    expected(batch(1, device)).float().sum().backward()
    for p, s, q in zip(model.parameters(), fp32_sum, expected.parameters()):
        assert p.grad is p.main_grad
        assert torch.equal(p.grad, s + q.grad.float())
    assert opt is not None


def test_deleting_the_optimizer_releases_hooks_and_main_grad(device):
    model = lp_model(device)
    opt = ampfused.FusedAmpAdamW(model.parameters())
    assert all(hasattr(p, "main_grad") for p in model.parameters())
    del opt
    gc.collect()
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    model(batch(0, device)).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_amsgrad_switched_on_later_keeps_the_moments(backend, device):
    p = torch.nn.Parameter(torch.randn(10, device=device))
    opt = ampfused.FusedAmpAdamW([p], backend=backend)
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step()
    exp_avg = opt.state[p]["exp_avg"].clone()
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["step"].item() == 4
    torch.testing.assert_close(opt.state[p]["exp_avg"], exp_avg * 0.9 + 0.1, **tol(backend))
    assert opt.state[p]["max_exp_avg_sq"].shape == p.shape


def test_unscale_reaches_a_non_contiguous_grad(backend, device):
    p = torch.nn.Parameter(torch.zeros(4, 6, device=device))
    opt = ampfused.FusedAmpAdamW([p], backend=backend)
    scaler = ampfused.GradScaler(device.type, init_scale=1024.0)
    scaler.scale(torch.zeros((), device=device))
    p.grad = (torch.ones(6, 4, device=device) * 1024.0).t()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(opt.grad_norm.cpu(), torch.tensor(math.sqrt(24.0)))


def test_a_strided_grad_holds_the_unscaled_gradient_after_every_scaled_step(backend, device):
    """A grad whose strides differ from its param's becomes a copy laid out as the param; after each
    scaled step of one plan (fresh grads of the same layout) p.grad holds the unscaled gradient, as
    torch's fused AdamW leaves it."""
    p = torch.nn.Parameter(torch.zeros(4, 6, device=device))
    opt = ampfused.FusedAmpAdamW([p], backend=backend)
    scaler = ampfused.GradScaler(device.type, init_scale=1000.0)  # (not a power of two: the unscale rounds)
    for step in range(3):
        scaler.scale(torch.zeros((), device=device))
        grad = torch.arange(24.0, device=device).view(6, 4) + step
        p.grad = (grad * 1000.0).t()
        scaler.step(opt)
        scaler.update()
        torch.testing.assert_close(p.grad, grad.t(), msg=f"step {step}")
        opt.zero_grad()


def test_one_scaler_for_several_optimizers_matches_torch(backend, device):
    trajectories = []
    for stock in (True, False):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(5, 5).to(device), torch.nn.Linear(5, 5).to(device)
        if stock:
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
            scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8, growth_interval=2)
        else:
            opts = [ampfused.FusedAmpAdamW(m.parameters(), lr=1e-2, backend=backend) for m in (a, b)]
            scaler = ampfused.GradScaler(device.type, init_scale=2.0**8, growth_interval=2)
        for step in range(8):
            for o in opts:
                o.zero_grad()
            x = torch.randn(3, 5, generator=torch.Generator().manual_seed(step)).to(device)
            scaler.scale(a(x).sum() + b(x).sum()).backward()
            if step in (2, 5):
                b.weight.grad[0, 0] = math.nan
            for o in opts:
                scaler.step(o)
            scaler.update()
            trajectories.append(scaler.get_scale())
        trajectories.append([p.detach().clone() for p in (*a.parameters(), *b.parameters())])
    half = len(trajectories) // 2
    assert trajectories[: half - 1] == trajectories[half:-1]
    for x, y in zip(trajectories[half - 1], trajectories[-1]):
        torch.testing.assert_close(x, y, **tol(backend))


def test_update_with_new_scale_still_counts_skips(backend, device):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = ampfused.FusedAmpAdamW([p], backend=backend)
    scaler = ampfused.GradScaler(device.type)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update(new_scale=128.0)
    assert scaler.get_scale() == 128.0 and scaler.skipped_steps == 3


def test_functional_validates_before_writing(device):
    p = [torch.zeros(3, device=device), torch.zeros(3, device=device)]
    g = [torch.ones(3, device=device)] * 2
    m, v = [torch.zeros(3, device=device) for _ in p], [torch.zeros(3, device=device) for _ in p]
    steps = [torch.zeros((), device=device) for _ in p]
    with pytest.raises(ValueError, match="max_exp_avg_sqs"):
        ampfused.functional.fused_amp_adamw(p, g, m, v, [None, None], steps, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,
                                            weight_decay=0.0, amsgrad=[False, True])
    assert all(s.item() == 0 for s in steps) and all(x.abs().sum() == 0 for x in p)
    norm, skipped = ampfused.functional.fused_amp_adamw([], [], [], [], [], [], lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    assert norm.item() == 0 and skipped.item() == 0


def test_load_state_dict_accepts_one_element_steps_and_rejects_bad_ones(backend, device):
    p = torch.nn.Parameter(torch.zeros(3, device=device))
    opt = ampfused.FusedAmpAdamW([p], lr=0.5, backend=backend)
    state = {"state": {0: {"step": torch.tensor([7.0]), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}},
             "param_groups": [{"params": [0], "lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                               "amsgrad": False, "maximize": False}]}
    opt.load_state_dict(state)
    assert opt.state[p]["step"].item() == 7 and opt.param_groups[0]["lr"] == 0.1
    state["state"][0]["step"] = torch.tensor([1.0, 2.0])
    state["param_groups"][0]["lr"] = 0.9
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict(state)
    assert opt.state[p]["step"].item() == 7 and opt.param_groups[0]["lr"] == 0.1
