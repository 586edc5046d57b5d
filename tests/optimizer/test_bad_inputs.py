"""Bad input gets a clear error that names the problem, and nothing is half-applied: params, state,
groups and gradients stay exactly as they were. Construction-time checks first, then inputs that
go bad after construction (gradients, params changed in place, state dicts). State-dict structure
errors (shape mismatch, an SGD dict, group count) live in test_skip_and_state_dict.py."""
import copy

import pytest
import torch

import ampfused
from helpers import assert_bitwise_equal, make_params, param, random_grads, snapshot

SHAPES = [(6, 4), (5,)]


# ---------------------------------------------------------------- at construction, and plain gradients
@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr"), (dict(eps=-1e-8), "eps"), (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]"), (dict(betas=(0.9,)), "betas"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), "lr"), (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(betas=(0.9, torch.tensor(0.99))), "betas must be either both floats or both Tensors"),
    (dict(betas=(torch.tensor(0.9), 0.99)), "betas must be either both floats or both Tensors"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm"), (dict(differentiable=True), "differentiable"),
])
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ampfused.FusedAmpAdamW([param(3)], **kwargs)


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(eps=-1e-8), dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.1)),
                                    dict(weight_decay=-0.1), dict(betas=(0.9, torch.tensor(0.99)))],
                         ids=["lr", "eps", "beta1", "beta2", "weight_decay", "beta_kinds"])
def test_invalid_hyperparameters_give_torchs_message(kwargs):
    """torch's own test_optim (test_errors) matches torch's message: ours starts with it (issue 26 item 5)."""
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW([param(3)], **kwargs)
    with pytest.raises(ValueError) as ours:
        ampfused.FusedAmpAdamW([param(3)], **kwargs)
    assert str(ours.value).startswith(str(theirs.value)), (str(ours.value), str(theirs.value))


WRONG_TYPES = [
    (dict(lr="3e-4"), "lr must be a float or a 1-element Tensor, got str '3e-4'"),
    (dict(lr=None), "lr must be a float or a 1-element Tensor, got NoneType"),
    (dict(betas=("a", 0.9)), r"betas\[0\] must be a float or a 1-element Tensor, got str 'a'"),
    (dict(betas=(0.9, None)), r"betas\[1\] must be a float or a 1-element Tensor, got NoneType"),
    (dict(eps=None), "eps must be a float, got NoneType None"),
    (dict(weight_decay="0.01"), "weight_decay must be a float, got str '0.01'"),
]


@pytest.mark.parametrize("kwargs,match", WRONG_TYPES)
def test_hyperparameters_of_the_wrong_type_name_it_and_the_type(kwargs, match):
    with pytest.raises(TypeError):  # stock torch refuses these too, with a raw comparison error
        torch.optim.AdamW([param(3)], **kwargs)
    with pytest.raises(TypeError, match=match):
        ampfused.FusedAmpAdamW([param(3)], **kwargs)
    with pytest.raises(TypeError, match=match):  # in a param group, at construction
        ampfused.FusedAmpAdamW([{"params": [param(3)]}, {"params": [param(2)], **kwargs}])
    opt = ampfused.FusedAmpAdamW([param(3)])
    with pytest.raises(TypeError, match=match):  # and added later: nothing is added
        opt.add_param_group({"params": [param(2)], **kwargs})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("path", ["functional", "group lr set after construction"])
def test_a_tensor_lr_of_two_elements_is_refused_by_name_and_writes_nothing(backend, path):
    from ampfused.functional import fused_amp_adamw

    lr = torch.tensor([1e-3, 1e-3])
    params = [torch.randn(4), torch.randn(3)]
    grads = [torch.ones_like(p) for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    before = [t.clone() for t in params + m + v + steps]
    with pytest.raises(ValueError, match=r"Tensor lr must be 1-element, got shape \(2,\)"):
        if path == "functional":
            fused_amp_adamw(params, grads, m, v, [None, None], steps, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, backend=backend)
        else:
            weights = [torch.nn.Parameter(p) for p in params]
            opt = ampfused.FusedAmpAdamW(weights, lr=1e-3, backend=backend)
            for w, g in zip(weights, grads):
                w.grad = g
            opt.param_groups[0]["lr"] = lr
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params + m + v + steps))


def test_numpy_and_int_hyperparameters_are_numbers():
    import numpy as np

    ampfused.FusedAmpAdamW([param(3)], lr=np.float32(1e-3), betas=(np.float64(0.9), 0.999), eps=1e-8, weight_decay=0)


@pytest.mark.parametrize("name,value,match", [
    ("lr", "3e-4", "lr must be a float or a 1-element Tensor, got str"),
    ("beta1", [0.9, "0.9"], r"beta1\[1\] must be a float or a 1-element Tensor, got str"),
    ("eps", None, "eps must be a float, got NoneType"),
    ("weight_decay", "0", "weight_decay must be a float, got str"),
])
def test_functional_hyperparameters_of_the_wrong_type_write_nothing(backend, name, value, match):
    from ampfused.functional import fused_amp_adamw

    params = [torch.randn(4), torch.randn(3)]
    grads = [torch.ones_like(p) for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    before = [t.clone() for t in params + m + v + steps]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    hyper[name] = value
    with pytest.raises(TypeError, match=match):
        fused_amp_adamw(params, grads, m, v, [None, None], steps, backend=backend, **hyper)
    assert all(torch.equal(a, b) for a, b in zip(before, params + m + v + steps))


def test_invalid_group_hyperparameters():
    with pytest.raises(ValueError, match="lr"):
        ampfused.FusedAmpAdamW([{"params": [param(3)]}, {"params": [param(2)], "lr": -1.0}])


def test_empty_params():
    with pytest.raises(ValueError, match="empty"):
        ampfused.FusedAmpAdamW([])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # torch's, at making the complex32 tensor
def test_unsupported_dtype():  # (float64 and complex params train: tests/optimizer/test_wide_params.py)
    with pytest.raises(ValueError, match="torch.int32 is not supported"):
        ampfused.FusedAmpAdamW([torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(ValueError, match="torch.complex32 is not supported"):
        ampfused.FusedAmpAdamW([torch.zeros(3, dtype=torch.complex32)])


def test_params_whose_elements_share_memory_are_refused_with_the_reason():
    # (params with gaps train: tests/optimizer/test_non_dense_params.py)
    with pytest.raises(ValueError, match=r"strides \(0, 1\) has elements that share memory"):
        ampfused.FusedAmpAdamW([torch.randn(1, 6).expand(4, 6).requires_grad_()])
    with pytest.raises(ValueError, match="share memory"):
        ampfused.FusedAmpAdamW([torch.randn(8).as_strided((3, 3), (2, 1)).requires_grad_()])


def test_sparse_gradients_raise_and_change_nothing(backend):
    a, b = param(5, 3), param(5, 3)
    opt = ampfused.FusedAmpAdamW([a, b], backend=backend)
    a.grad = torch.ones_like(a)
    b.grad = torch.ones_like(b).to_sparse()
    before = a.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(a, before) and not any(opt.state.values())


def test_wrong_gradient_shape(backend):
    """The shape check of the plain p.grad path (an fp32 param: no main_grad)."""
    a = param(4)
    opt = ampfused.FusedAmpAdamW([a], backend=backend)
    a.grad = torch.ones(4)
    a.grad.data = torch.ones(5)  # sneaks past autograd's own shape check
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()


def test_dtype_changed_after_construction(backend):
    model = torch.nn.Linear(3, 3)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    model.half()
    model(torch.randn(2, 3, dtype=torch.half)).sum().backward()
    with pytest.raises(RuntimeError, match="after the optimizer was built"):
        opt.step()


# ---------------------------------------------------------------- after construction


def trained(backend, device, dtype=torch.float32, steps=2, **kwargs):
    params = make_params(SHAPES, dtype=dtype, device=device)
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend, **kwargs)
    for step in range(steps):
        for p, g in zip(params, random_grads(params, step)):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad()
    return params, opt


def full_snapshot(opt, params):
    snap = snapshot(opt, params)
    snap["params"] = [p.detach().contiguous().clone() for p in params]  # bitwise views need unit stride
    snap["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    snap["group_params"] = [list(map(id, g["params"])) for g in opt.param_groups]
    return snap


def assert_untouched(before, opt, params):
    after = full_snapshot(opt, params)
    assert before.pop("groups") == after.pop("groups")
    assert before.pop("group_params") == after.pop("group_params")
    assert_bitwise_equal(before, after)


# ------------------------------------------------------------------------- state dicts


def _mutated_state_dict(opt, how):
    sd = copy.deepcopy(opt.state_dict())
    if how == "fewer params in the group":
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:1]
        sd["state"].pop(1, None)
    elif how == "state for an unlisted param":
        sd["state"][7] = copy.deepcopy(sd["state"][0])
    elif how == "Adagrad state":
        sd["state"] = {i: {"step": s["step"], "sum": s["exp_avg_sq"]} for i, s in sd["state"].items()}
    elif how == "transposed moments":
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].t().contiguous()
    elif how == "master of another shape":
        sd["state"][1]["master_param"] = torch.zeros(4)
    elif how == "a string for a moment":
        sd["state"][1]["exp_avg_sq"] = "exp_avg_sq.pt"
    elif how == "a string for the master":
        sd["state"][0]["master_param"] = "master"
    elif how == "a string for the step":
        sd["state"][1]["step"] = "2"
    elif how == "a list for an entry":
        sd["state"][1] = [sd["state"][1]["exp_avg"]]
    return sd


FOREIGN_STATE_DICTS = [
    ("fewer params in the group", "doesn't match the size"),
    ("state for an unlisted param", "which no parameter group lists"),
    ("Adagrad state", "not an AdamW state dict"),
    ("transposed moments", "another model or optimizer"),
    ("a string for a moment", "state 'exp_avg_sq' of parameter 1 is a str, not a tensor"),
    ("a string for the step", r"state 'step' of parameter 1 is a str \('2'\); expected a tensor or a number"),
    ("a list for an entry", "state of parameter 1 is a list, not a dict of tensors"),
]


@pytest.mark.parametrize("how,match,dtype", [
    *[(how, match, dtype) for how, match in FOREIGN_STATE_DICTS for dtype in (torch.float32, torch.bfloat16)],
    ("master of another shape", "another model or optimizer", torch.bfloat16),  # fp32 params have no master
    ("a string for the master", "state 'master_param' of parameter 0 is a str, not a tensor", torch.bfloat16),
])
def test_foreign_state_dict_is_refused_and_changes_nothing(backend, device, how, match, dtype):
    params, opt = trained(backend, device, dtype, amsgrad=True)
    sd = _mutated_state_dict(opt, how)
    before = full_snapshot(opt, params)
    opt.param_groups[0]["lr"] = 0.25  # a live scheduler change must survive the failed load
    before["groups"][0]["lr"] = 0.25
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_untouched(before, opt, params)
    for p, g in zip(params, random_grads(params, 50)):  # and the optimizer still trains
        p.grad = g.to(p.dtype)
    opt.step()
    assert opt.state[params[0]]["step"].item() == 3


# ------------------------------------------------------------------------- params changed after construction


def test_params_converted_after_construction_fp16_to_fp32(backend, device):
    """The reverse of model.half(): a bf16 model turned float() after the optimizer was built."""
    model = torch.nn.Linear(4, 3).to(device=device, dtype=torch.bfloat16)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
    model(torch.randn(2, 4, device=device, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    opt.zero_grad()
    params = list(opt.param_groups[0]["params"])
    model.float()
    before = full_snapshot(opt, params)
    model(torch.randn(2, 4, device=device)).sum().backward()
    with pytest.raises(RuntimeError, match="after the optimizer was built"):
        opt.step()
    assert_untouched(before, opt, params)


def test_param_made_an_overlapping_view_after_construction(backend, device):
    params, opt = trained(backend, device)
    params[0].data = torch.randn(1, params[0].shape[1], device=device).expand(params[0].shape)  # same shape, overlaps
    before = full_snapshot(opt, params)
    for p, g in zip(params, random_grads(params, 7)):
        p.grad = g
    with pytest.raises(RuntimeError, match="share memory.*after the optimizer was built"):
        opt.step()
    assert_untouched(before, opt, params)


def test_param_repointed_after_construction_is_followed(backend, device):
    """p.data replaced by new contiguous memory (e.g. a checkpoint load with assign=True): the step
    must update the new storage, not the old one (pointer tables are rebuilt when a pointer changes)."""
    params, opt = trained(backend, device)
    mirror = [p.detach().clone().requires_grad_() for p in params]
    ref = ampfused.FusedAmpAdamW(mirror, lr=1e-2, backend="reference")
    ref.load_state_dict(opt.state_dict())
    old = params[0].data
    params[0].data = old.clone()
    for q, p, g in zip(mirror, params, random_grads(params, 9)):
        p.grad, q.grad = g, g.clone()
    opt.step()
    ref.step()
    assert not torch.equal(params[0].detach(), old), "the step wrote to the old storage"
    for p, q in zip(params, mirror):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)


@pytest.mark.gpu
def test_model_moved_to_another_device_after_construction(backend):
    model = torch.nn.Linear(4, 3)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    model.cuda()
    params = list(opt.param_groups[0]["params"])
    if not all(p.is_cuda for p in params):
        pytest.skip("this torch swaps Parameters on .cuda(): the optimizer keeps the CPU ones")
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    with pytest.raises(RuntimeError, match="after the optimizer was built"):
        opt.step()
    assert not any(opt.state.values())


# ------------------------------------------------------------------------- several devices


def test_params_on_several_devices_are_refused_at_construction():
    cpu, meta = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        ampfused.FusedAmpAdamW([cpu, meta])
    with pytest.raises(ValueError, match="several devices"):
        ampfused.FusedAmpAdamW([{"params": [cpu]}, {"params": [meta], "lr": 0.1}])


def test_param_group_on_another_device_is_refused_and_changes_nothing(backend, device):
    params, opt = trained(backend, device)
    before = full_snapshot(opt, params)
    with pytest.raises(ValueError, match="several devices"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, device="meta"))], "lr": 0.1})
    assert_untouched(before, opt, params)
    for p, g in zip(params, random_grads(params, 3)):
        p.grad = g
    opt.step()


@pytest.mark.gpu
def test_params_on_cpu_and_cuda_are_refused():
    with pytest.raises(ValueError, match="several devices"):
        ampfused.FusedAmpAdamW([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, device="cuda"))])


# ------------------------------------------------------------------------- gradients


def _sneak_grad(p, grad):
    """Install a gradient autograd would refuse (dtype/device), as buggy user code can via .data."""
    p.grad = torch.zeros_like(p)
    p.grad.data = grad


@pytest.mark.parametrize("dtype,accumulate", [  # fp32 params never accumulate (True would warn so): one case
    (torch.float32, None), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_float64_gradient_is_refused_and_changes_nothing(backend, device, dtype, accumulate):
    params, opt = trained(backend, device, dtype, fp32_grad_accumulation=accumulate)
    before = full_snapshot(opt, params)
    main_before = [p.main_grad.clone() for p in params] if accumulate and dtype != torch.float32 else None
    params[0].grad = random_grads(params, 4)[0].to(dtype)
    params[1].grad = torch.zeros_like(params[1])
    params[1].grad.data = torch.ones(params[1].shape, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match="float64"):
        opt.step()
    assert_untouched(before, opt, params)
    if main_before is not None:
        assert torch.equal(params[1].main_grad, main_before[1]), "the bad gradient reached main_grad"


def test_wrong_gradient_shape_for_an_accumulated_param(backend, device):
    """The shape check of the main_grad path (test_wrong_gradient_shape covers the plain p.grad path)."""
    params, opt = trained(backend, device, torch.bfloat16)
    before = full_snapshot(opt, params)
    params[1].grad = torch.zeros_like(params[1])
    params[1].grad.data = torch.ones(7, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()
    assert_untouched(before, opt, params)
    assert not params[1].main_grad.any()


@pytest.mark.parametrize("accumulate", [True, False])
def test_fp32_gradients_for_bf16_params_through_grad_dtype(backend, device, accumulate):
    """torch lets a bf16 param ask autograd for fp32 grads (p.grad_dtype): a legitimate input."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("this torch has no Tensor.grad_dtype")
    runs = []
    for grad_dtype in (None, torch.float32):
        params = make_params(SHAPES, dtype=torch.bfloat16, device=device)
        if grad_dtype is not None:
            for p in params:
                p.grad_dtype = grad_dtype
        opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend, fp32_grad_accumulation=accumulate)
        for step in range(3):
            for micro in range(2):
                g = random_grads(params, 10 * step + micro)
                sum((p.float() * x).sum() for p, x in zip(params, g)).backward()
            opt.step()
            opt.zero_grad()
        runs.append((params, opt))
    (ref_params, ref_opt), (params, opt) = runs
    for p, q in zip(ref_params, params):
        torch.testing.assert_close(opt.state[q]["master_param"], ref_opt.state[p]["master_param"], rtol=1e-2, atol=1e-2)
        assert torch.equal(q.detach(), opt.state[q]["master_param"].to(torch.bfloat16))


def test_non_contiguous_gradients_are_read_correctly(backend, device):
    """Strided grads (e.g. from a transposed matmul) give the same step as contiguous copies."""
    runs = []
    for strided in (False, True):
        params = make_params([(6, 4), (3, 5)], dtype=torch.bfloat16, device=device)
        opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend, fp32_grad_accumulation=False)
        for step in range(3):
            for p, g in zip(params, random_grads(params, step)):
                g = g.to(p.dtype)
                p.grad = g.t().contiguous().t() if strided else g
                assert p.grad.is_contiguous() != strided
            opt.step()
            opt.zero_grad()
        runs.append(params)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_compact_state_that_is_not_a_tensor_is_refused_and_changes_nothing(backend, device):
    params, opt = trained(backend, device, torch.bfloat16, state_dtype="int8", master_weights="split16")
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_codes"] = None
    before = full_snapshot(opt, params)
    with pytest.raises(ValueError, match="state 'exp_avg_codes' of parameter 0 is a NoneType, not a tensor"):
        opt.load_state_dict(sd)
    assert_untouched(before, opt, params)
