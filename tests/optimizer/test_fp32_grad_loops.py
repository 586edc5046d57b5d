"""Tutorial loops on fp16/bf16 models with only torch.optim.AdamW -> FusedAmpAdamW swapped (DESIGN §3).

The oracle of every test is the hand-written fp32-master recipe with stock torch: the same low-precision
model, each micro-batch's gradients summed in fp32 into fp32 master copies, the user's own clipping
and ``torch.optim.AdamW`` on the masters, and the masters rounded back into the model.
"""
import copy
import gc
import io
import math

import pytest
import torch

import ampfused
from ampfused import _compiled
from helpers import mlp, tol

LR = 1e-2


def model_of(dtype, device, seed=0):
    return mlp(6, 16, 3, dtype=dtype, device=device, seed=seed)


def micro_input(i, dtype, device):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 6, generator=g).to(device=device, dtype=dtype)


def square_loss(model, x):
    return model(x).float().pow(2).mean()


class Fp32MasterOracle:
    """The stock recipe: fp32 masters with fp32-accumulated grads, stock AdamW and the user's clip."""

    def __init__(self, dtype, device):
        self.model = model_of(dtype, device)
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=LR)

    def backward(self, x, scale=1.0):
        (square_loss(self.model, x) * scale).backward()
        for p, m in zip(self.model.parameters(), self.masters):
            m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
            p.grad = None

    def step(self, clip=None, inv_scale=1.0):
        if inv_scale != 1.0:
            for m in self.masters:
                m.grad.mul_(inv_scale)
        norm = torch.nn.utils.clip_grad_norm_(self.masters, clip) if clip is not None else None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)
        return norm


def assert_matches_oracle(opt, model, oracle, backend):
    for p, m in zip(model.parameters(), oracle.masters):
        state, ref = opt.state[p], oracle.opt.state[m]
        torch.testing.assert_close(state["master_param"], m.detach(), **tol(backend))
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], ref[key], **tol(backend), msg=key)
        assert state["step"].item() == ref["step"].item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clear", ["opt.zero_grad", "model.zero_grad", "grad=None", "set_to_none=False"])
def test_grad_accumulation_with_the_users_own_clip(backend, device, dtype, clear):
    """The gradient-accumulation tutorial: N backward()s, clip_grad_norm_(model.parameters(), 1.0), step, clear."""
    model = model_of(dtype, device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=LR, backend=backend)
    oracle = Fp32MasterOracle(dtype, device)
    for step in range(3):
        for k in range(3):
            x = micro_input(step * 3 + k, dtype, device)
            square_loss(model, x).backward()
            oracle.backward(x)
            for p, m in zip(model.parameters(), oracle.masters):
                assert p.grad.dtype == torch.float32 and p.grad is p.main_grad
                assert torch.equal(p.grad, m.grad), "p.grad must be, bitwise, the in-order fp32 sum of the micro-batches"
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        expected = oracle.step(clip=0.05)
        assert norm.dtype == torch.float32 and torch.equal(norm, expected), "the user's clip must see the fp32 gradient"
        assert norm > 0.05, "the test must actually clip"
        opt.step()
        if clear == "opt.zero_grad":
            opt.zero_grad()
        elif clear == "model.zero_grad":
            model.zero_grad()
        elif clear == "grad=None":
            for p in model.parameters():
                p.grad = None
        else:
            opt.zero_grad(set_to_none=False)
            assert all(p.grad is p.main_grad and not p.grad.any() for p in model.parameters())
    assert_matches_oracle(opt, model, oracle, backend)


def test_fp16_with_torch_grad_scaler_unscale_and_clip(backend, device):
    """The fp16 tutorial with stock torch.amp.GradScaler: scale, backward x2, unscale_, clip_grad_norm_, step, update."""
    dtype = torch.float16
    model = model_of(dtype, device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=LR, backend=backend)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    oracle = Fp32MasterOracle(dtype, device)
    oracle_scale = 2.0**10
    for step in range(4):
        for k in range(2):
            x = micro_input(step * 2 + k, dtype, device)
            scaler.scale(square_loss(model, x)).backward()
            oracle.backward(x, scale=oracle_scale)
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        expected = oracle.step(clip=0.05, inv_scale=1.0 / oracle_scale)
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == 2.0**12, "two growth intervals of good steps"
    assert_matches_oracle(opt, model, oracle, backend)


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, ampfused.GradScaler])
def test_both_scalers_skip_an_overflow_and_back_off_alike(backend, device, scaler_class):
    model = model_of(torch.float16, device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=LR, backend=backend)
    scaler = scaler_class(device.type, init_scale=2.0**10)
    scaler.scale(square_loss(model, micro_input(0, torch.float16, device))).backward()
    model[0].weight.grad[0, 0] = math.inf  # the fp32 accumulated gradient overflowed
    weights = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert all(not opt.state[p] or opt.state[p]["step"].item() == 0 for p in model.parameters())


def test_bf16_users_clip_and_the_max_grad_norm_fast_path_agree(backend, device):
    """clip_grad_norm_ on p.grad and the fused max_grad_norm= give the same norms and the same training."""
    results, norms = [], []
    for fused_clip in (False, True):
        model = model_of(torch.bfloat16, device)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=LR, backend=backend, max_grad_norm=0.05 if fused_clip else None)
        run_norms = []
        for step in range(3):
            square_loss(model, micro_input(step, torch.bfloat16, device)).backward()
            if not fused_clip:
                run_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            opt.step()
            if fused_clip:
                run_norms.append(opt.grad_norm.clone())
            opt.zero_grad()
        norms.append(run_norms)
        results.append([opt.state[p]["master_param"].clone() for p in model.parameters()])
    for a, b in zip(*norms):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, **tol(backend))


def test_hooks_and_logging_see_the_fp32_gradient(backend, device):
    model = model_of(torch.bfloat16, device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=LR, backend=backend)
    seen = []
    for p in model.parameters():  # registered after the optimizer, as a user's logging hook would be
        p.register_post_accumulate_grad_hook(lambda p: seen.append((p.grad.dtype, p.grad is p.main_grad)))
    for k in range(2):
        square_loss(model, micro_input(k, torch.bfloat16, device)).backward()
    assert len(seen) == 2 * len(list(model.parameters())), "a user's hook runs on every micro-batch"
    assert all(s == (torch.float32, True) for s in seen)
    grad_norms = {name: p.grad.norm().item() for name, p in model.named_parameters()}
    assert all(v > 0 for v in grad_norms.values())
    opt.step()


def test_at_most_one_low_precision_gradient_alive_and_no_zeroing_pass(device):
    """Profile one micro-batch after a clear and one after it: what runs per param."""
    from torch.profiler import ProfilerActivity, profile

    params = [torch.nn.Parameter(torch.randn(64, device=device).to(torch.bfloat16)) for _ in range(5)]
    opt = ampfused.FusedAmpAdamW(params, lr=LR)
    x = torch.randn(64, device=device).to(torch.bfloat16)

    def ops_of_one_backward():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sum((p * x).sum() for p in params).backward()
        top = [e for e in prof.events() if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        return [e.name for e in top if e.name.startswith(("aten::", "ampfused::"))]

    first = ops_of_one_backward()  # p.grad is None: the hook writes the bf16 grad into main_grad
    assert first.count("aten::copy_") == len(params) and "aten::add_" not in first
    assert not {"aten::zero_", "aten::fill_", "aten::zeros"} & set(first), "no zeroing pass"
    # micro-batch 2: an in-place add into the fp32 p.grad, the post-accumulate hook does nothing. On a
    # CPU it is our C++ pre-hook's fused cast-and-add (csrc/accumulate_hook.cpp), else autograd's add_.
    second = ops_of_one_backward()
    cpu_hook = torch.device(device).type == "cpu" and _compiled.load()[0] is not None
    adder, not_run = ("ampfused::accumulate", "aten::add_") if cpu_hook else ("aten::add_", "ampfused::accumulate")
    assert second.count(adder) == len(params) and not_run not in second and "aten::copy_" not in second
    assert all(p.grad is p.main_grad for p in params)
    opt.step()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_user_tensor_hooks_and_create_graph_feed_the_fp32_sum(device):
    """A user's p.register_hook runs before the fp32 accumulation sees g; create_graph still accumulates."""
    model, oracle = model_of(torch.bfloat16, device), model_of(torch.bfloat16, device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=LR)  # alive to the end: it owns the fp32 grads
    for p in list(model.parameters()) + list(oracle.parameters()):
        p.register_hook(lambda g: g * 2)
    sums = [torch.zeros(p.shape, device=device) for p in oracle.parameters()]
    for k in range(3):
        x = micro_input(k, torch.bfloat16, device)
        square_loss(model, x).backward(create_graph=(k == 2))
        square_loss(oracle, x).backward()
        for total, p in zip(sums, oracle.parameters()):
            total += p.grad.float()
            p.grad = None
    for total, p in zip(sums, model.parameters()):
        assert p.grad is p.main_grad and torch.equal(p.grad.detach(), total)
    del opt


def _adders_of_one_backward(params, x):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sum((p * x).sum() for p in params).backward()
    return [e.name for e in prof.events() if e.name in ("aten::add_", "ampfused::accumulate")]


@pytest.mark.skipif(_compiled.load()[0] is None, reason="the CPU accumulation hook is part of ampfused._C")
def test_cpu_accumulation_hook_follows_relayouts_and_leaves_with_the_optimizer():
    params = [torch.nn.Parameter(torch.randn(32).to(torch.bfloat16)) for _ in range(3)]
    x = torch.randn(32).to(torch.bfloat16)
    opt = ampfused.FusedAmpAdamW(params[:2], lr=LR)
    _adders_of_one_backward(params[:2], x)
    opt.add_param_group({"params": params[2:]})  # a re-layout: every param gets a new main_grad view
    assert _adders_of_one_backward(params, x) == ["ampfused::accumulate"] * 2  # p2's first: a copy
    assert _adders_of_one_backward(params, x) == ["ampfused::accumulate"] * 3
    expected = [3 * x.float(), 3 * x.float(), 2 * x.float()]
    assert all(p.grad is p.main_grad and torch.equal(p.grad, e) for p, e in zip(params, expected))
    del opt
    gc.collect()
    assert _adders_of_one_backward(params, x) == ["aten::add_"] * 3  # the hooks left with the optimizer


def test_channels_last_params_train_like_torch(backend, device):
    for convert_after in (False, True):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 8, 3).to(device)
        ref = copy.deepcopy(conv)
        if not convert_after:
            conv, ref = conv.to(memory_format=torch.channels_last), ref.to(memory_format=torch.channels_last)
        opt = ampfused.FusedAmpAdamW(conv.parameters(), lr=LR, backend=backend)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        for step in range(3):
            if convert_after and step == 1:
                conv, ref = conv.to(memory_format=torch.channels_last), ref.to(memory_format=torch.channels_last)
            x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step)).to(device)
            for m, o in ((conv, opt), (ref, ref_opt)):
                m(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
        for p, q in zip(conv.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **tol(backend))
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], **tol(backend))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_the_optimizer_train(backend, device, how):
    model = model_of(torch.bfloat16, device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=LR, backend=backend, max_grad_norm=1.0)
    square_loss(model, micro_input(0, torch.bfloat16, device)).backward()
    opt.step()
    opt.zero_grad()
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        buf = io.BytesIO()
        torch.save((model, opt), buf) if how == "torch.save" else buf.write(__import__("pickle").dumps((model, opt)))
        buf.seek(0)
        model2, opt2 = torch.load(buf, weights_only=False) if how == "torch.save" else __import__("pickle").loads(buf.read())
    assert opt2.param_groups[0]["params"][0] is model2[0].weight
    for m, o in ((model, opt), (model2, opt2)):
        for k in range(2):
            square_loss(m, micro_input(1 + k, torch.bfloat16, device)).backward()
        assert all(p.grad is p.main_grad and p.grad.dtype == torch.float32 for p in m.parameters())
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()
        for key in ("step", "exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_duplicate_param_in_a_group_is_refused_before_anything_is_written(backend, device):
    p = torch.nn.Parameter(torch.randn(4, device=device))
    with pytest.raises(ValueError, match="more than once"):
        ampfused.FusedAmpAdamW([p, p], backend=backend)
    opt = ampfused.FusedAmpAdamW([p], backend=backend)
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [p]})  # torch's own check: a param in two groups
    assert len(opt.param_groups) == 1


def test_param_groups_carry_torch_adamw_keys_and_checkpoints_load_both_ways(backend, device):
    p = torch.nn.Parameter(torch.randn(5, device=device))
    stock = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())])
    opt = ampfused.FusedAmpAdamW([p], backend=backend, foreach=True, fused=False)
    assert set(stock.param_groups[0]) <= set(opt.param_groups[0]) and set(stock.defaults) <= set(opt.defaults)
    group = opt.param_groups[0]
    assert group["fused"] is True and group["foreach"] is False and group["capturable"] is True
    assert group["differentiable"] is False and group["decoupled_weight_decay"] is True
    p.grad = torch.ones_like(p)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    into_torch = torch.optim.AdamW([q])
    into_torch.load_state_dict(opt.state_dict())  # trains as a fresh torch AdamW would
    q.grad = torch.ones_like(q)
    into_torch.step()
    back = ampfused.FusedAmpAdamW([torch.nn.Parameter(q.detach().clone())], backend=backend)
    back.load_state_dict(into_torch.state_dict())
    assert back.param_groups[0]["fused"] is True and back.state[back.param_groups[0]["params"][0]]["step"].item() == 2


def test_repr_shows_backend_and_flags(backend, device):
    params = [torch.nn.Parameter(torch.randn(3, device=device).to(torch.bfloat16)), torch.nn.Parameter(torch.randn(3, device=device))]
    opt = ampfused.FusedAmpAdamW(params, backend=backend, max_grad_norm=1.0)
    text = repr(opt)
    assert f"backend: {backend}" in text and "max_grad_norm: 1.0" in text
    assert "fp32 master weights: 1 of 1" in text and "fp32 grad accumulation: 1 of 1" in text


@pytest.mark.gpu
def test_one_kernel_per_param_per_micro_batch_on_cuda():
    """On a GPU the in-place fp32 += bf16 of AccumulateGrad is one kernel (10 B/param); the first
    micro-batch after a clear is one cast-copy kernel (6 B/param); nothing else runs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    params = [torch.nn.Parameter(torch.randn(4096, device="cuda").to(torch.bfloat16)) for _ in range(7)]
    grads = [torch.randn(4096, device="cuda").to(torch.bfloat16) for _ in params]
    opt = ampfused.FusedAmpAdamW(params, lr=LR)

    def kernels_of_one_backward():
        fresh = [g.clone() for g in grads]  # autograd hands these over: made outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.autograd.backward(params, fresh)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]

    torch.autograd.backward(params, [g.clone() for g in grads])  # warm up
    opt.zero_grad()
    first = kernels_of_one_backward()
    later = kernels_of_one_backward()
    assert len(first) == len(params) and len(later) == len(params), (first, later)
    assert all(p.grad is p.main_grad for p in params)
