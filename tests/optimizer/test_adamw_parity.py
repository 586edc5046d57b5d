"""FusedAmpAdamW on fp32 params equals torch.optim.AdamW, option by option (DESIGN §2.4, §2.6)."""
import pytest
import torch

import ampfused
from helpers import assert_states_close, clone_params, make_params, random_grads

SHAPES = [(31, 7), (1025,), (97,), (1,), (8, 4, 3)]
STEPS = 20

OPTIONS = {
    "default": {},
    "amsgrad": dict(amsgrad=True),
    "maximize": dict(maximize=True),
    "no_decay": dict(weight_decay=0.0),
    "strong_decay_high_lr": dict(lr=3e-2, weight_decay=0.3),
    "betas_eps": dict(betas=(0.8, 0.95), eps=1e-6),
    "amsgrad_maximize": dict(amsgrad=True, maximize=True, lr=1e-2),
}


def run_pair(backend, device, options, steps=STEPS, groups=None, grad_pattern=None):
    base = make_params(SHAPES, device=device)
    ref_params, amp_params = clone_params(base), clone_params(base)
    split = groups or (lambda ps: ps)
    ref = torch.optim.AdamW(split(ref_params), **options)
    amp = ampfused.FusedAmpAdamW(split(amp_params), backend=backend, **options)
    for step in range(steps):
        grads = random_grads(base, seed=step)
        for i, (pr, pa, g) in enumerate(zip(ref_params, amp_params, grads)):
            has_grad = grad_pattern is None or grad_pattern(step, i)
            pr.grad = g.clone() if has_grad else None
            pa.grad = g.clone() if has_grad else None
        ref.step()
        amp.step()
    return ref, ref_params, amp, amp_params


@pytest.mark.parametrize("name", OPTIONS)
def test_matches_torch_adamw(backend, device, name):
    ref, ref_params, amp, amp_params = run_pair(backend, device, OPTIONS[name])
    assert_states_close(ref, ref_params, amp, amp_params, backend)
    assert all(amp.state[p]["exp_avg"].dtype == torch.float32 for p in amp_params)


def test_param_groups_with_own_hyperparameters(backend, device):
    def groups(ps):
        return [
            {"params": ps[:2], "lr": 5e-3, "weight_decay": 0.0, "betas": (0.85, 0.99)},
            {"params": ps[2:4], "amsgrad": True, "eps": 1e-5},
            {"params": ps[4:], "maximize": True, "lr": 2e-3},
        ]

    ref, ref_params, amp, amp_params = run_pair(backend, device, dict(lr=1e-3), groups=groups)
    assert_states_close(ref, ref_params, amp, amp_params, backend)


@pytest.mark.parametrize("lr_shape", [(), (1,), (1, 1)], ids=["0d", "1d", "2d"])
def test_tensor_lr(backend, device, lr_shape):
    # capturable keeps torch's tensor-lr path free of .item(); results are the same AdamW. Any
    # 1-element shape: torch squeezes a tensor lr to 0-d before it meets the params (_to_scalar), so a
    # [1, 1] lr steps 1-d params too (torch's test_optim test_tensor_lr, num_dim=2; issue 26 item 5)
    base = make_params(SHAPES, device=device)
    ref_params, amp_params = clone_params(base), clone_params(base)
    ref = torch.optim.AdamW(ref_params, lr=torch.tensor(4e-3).reshape(lr_shape))
    amp = ampfused.FusedAmpAdamW(amp_params, backend=backend, lr=torch.tensor(4e-3).reshape(lr_shape))
    for step in range(STEPS):
        for pr, pa, g in zip(ref_params, amp_params, random_grads(base, step)):
            pr.grad, pa.grad = g.clone(), g.clone()
        ref.step()
        amp.step()
        for opt in (ref, amp):  # the value changes in place, as a tensor-lr scheduler would
            opt.param_groups[0]["lr"].mul_(0.95)
    assert_states_close(ref, ref_params, amp, amp_params, backend)


def test_params_without_grads_are_left_alone(backend, device):
    """Params whose grad is None are not stepped and get state lazily, as in torch."""
    pattern = lambda step, i: not (i == 1 and step < 5) and not (i == 3 and step % 3 == 0)  # noqa: E731
    ref, ref_params, amp, amp_params = run_pair(backend, device, dict(lr=1e-2), grad_pattern=pattern)
    assert_states_close(ref, ref_params, amp, amp_params, backend)
    assert amp.state[amp_params[1]]["step"].item() == STEPS - 5


def test_state_is_lazy_and_flat(backend, device):
    params = make_params(SHAPES, device=device)
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    assert len(opt.state) == 0 and opt.grad_norm is None
    for p, g in zip(params, random_grads(params, 0)):
        p.grad = g
    opt.step()
    storages = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1, "exp_avg views must share one flat buffer"
    for p in params:
        state = opt.state[p]
        assert state["exp_avg"].shape == p.shape and state["step"].shape == ()
        assert state["exp_avg"].data_ptr() % 128 == 0
        assert state["step"].device == p.device and state["step"].dtype == torch.float32


@pytest.mark.parametrize("lr_kind", ["float", "tensor_2d"])
def test_functional_api_matches_class(backend, device, lr_kind):
    # tensor_2d: a [1, 1] lr, squeezed as torch squeezes it, in the functional API's grouping too
    lr = 1e-2 if lr_kind == "float" else torch.tensor([[1e-2]], device=device)
    params = make_params(SHAPES, device=device)
    twin = clone_params(params)
    opt = ampfused.FusedAmpAdamW(twin, lr=lr, backend=backend, max_grad_norm=1.0)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device=device) for _ in params]
    for step in range(5):
        grads = random_grads(params, step)
        for p, g in zip(twin, grads):
            p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            norm, skipped = ampfused.functional.fused_amp_adamw(
                params, grads, exp_avgs, exp_avg_sqs, [None] * len(params), steps, lr=lr, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=1e-2, max_grad_norm=1.0, backend=backend)
        assert skipped.item() == 0
        torch.testing.assert_close(norm, opt.grad_norm)
    for p, q in zip(params, twin):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_closure_is_called_with_grad_enabled(backend, device):
    params = make_params([(4,)], device=device)
    opt = ampfused.FusedAmpAdamW(params, backend=backend)

    def closure():
        opt.zero_grad()
        loss = (params[0] ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and opt.state[params[0]]["step"].item() == 1


def test_named_parameters_like_torch(backend, device):
    model = torch.nn.Linear(3, 2).to(device)
    opt = ampfused.FusedAmpAdamW(model.named_parameters(), backend=backend)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    model(torch.randn(4, 3, device=device)).sum().backward()
    opt.step()
    assert ampfused.FusedAmpAdamW(model.parameters()).state_dict()["param_groups"][0]["params"] == [0, 1]
