"""Training loops as users write them for torch.optim.AdamW, with only the optimizer swapped.

The oracle is stock torch (torch.optim.AdamW on an identical copy of the model and data, or the
fp32-master recipe written by hand for fp16/bf16 params); every test runs on every backend.
"""
import copy
from collections import defaultdict

import pytest
import torch
from torch.optim import lr_scheduler

import ampfused
from helpers import (STATE_KEYS, assert_states_close, clone_params, load_in_order, make_params, mlp, random_grads,
                     through_disk, tol)

SHAPES = [(7, 5), (5,), (3, 4, 2)]


class BranchedNet(torch.nn.Module):
    """Embedding, an optional branch (unused on most steps), LayerNorm, and a frozen head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.branch = torch.nn.Linear(6, 6)
        self.l1 = torch.nn.Linear(6, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.l2 = torch.nn.Linear(8, 3)
        self.head = torch.nn.Linear(3, 3)
        self.head.requires_grad_(False)

    def forward(self, x, use_branch=False):
        h = self.emb(x).mean(1)
        if use_branch:
            h = self.branch(h)
        return self.head(self.l2(self.ln(torch.tanh(self.l1(h)))))


def twin_nets(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    a = BranchedNet().to(device=device, dtype=dtype)
    b = BranchedNet().to(device=device, dtype=dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def data(step, device):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 10, (4, 5), generator=g).to(device), torch.randn(4, 3, generator=g).to(device)


def net_loss(model, step, device, use_branch=False):
    x, y = data(step, device)
    return ((model(x, use_branch=use_branch).float() - y) ** 2).mean()


def decay_groups(model, lr):
    """The HF/nanoGPT grouping: weight decay on matrices only, biases and LayerNorm without (own lr here)."""
    named = [(n, p) for n, p in model.named_parameters() if "branch" not in n]
    return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": 2 * lr}]


def assert_like_torch(ref_opt, ref_model, opt, model, backend):
    assert_states_close(ref_opt, list(ref_model.parameters()), opt, list(model.parameters()), backend)
    for gr, ga in zip(ref_opt.param_groups, opt.param_groups, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert torch.allclose(torch.as_tensor(ga[key], dtype=torch.float64), torch.as_tensor(gr[key], dtype=torch.float64)), key


# ------------------------------------------------------------------------------------------ confirmed bugs


def _beside_torch(backend, device, steps, change_at, change):
    """``steps`` steps of torch's AdamW and of FusedAmpAdamW on the same params and grads, ``change(opt,
    params)`` applied to both before step ``change_at``: ((torch's opt, params), (ours, params))."""
    base = make_params(SHAPES, device=device)
    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: ampfused.FusedAmpAdamW(ps, lr=1e-2, backend=backend)):
        params = clone_params(base)
        opt = make(params)
        for step in range(steps):
            if step == change_at:
                change(opt, params)
            for p, g in zip(params, random_grads(base, step)):
                p.grad = g.clone()
            opt.step()
        runs.append((opt, params))
    return runs


@pytest.mark.parametrize("how", ["state.clear()", "state = defaultdict(dict)", "del state[p]", "state[p].clear()"])
def test_resetting_the_optimizer_state_restarts_adam_like_torch(backend, device, how):
    """Resetting Adam's moments mid-training (continual learning, RL, re-initialised layers) is done by
    emptying ``opt.state``; torch then starts those params afresh (step 1, zero moments) and keeps the
    new state in ``opt.state`` / ``state_dict()``. ampfused keeps stepping the old flat views."""
    def reset(opt, params):
        if how == "state.clear()":
            opt.state.clear()
        elif how == "state = defaultdict(dict)":
            opt.state = defaultdict(dict)
        elif how == "state[p].clear()":
            opt.state[params[0]].clear()
        else:
            del opt.state[params[0]]

    (ref, ref_params), (amp, amp_params) = _beside_torch(backend, device, steps=6, change_at=3, change=reset)
    assert amp.state.get(amp_params[0]), "after the reset, steps ran on state that opt.state no longer holds"
    assert amp.state[amp_params[0]]["step"].item() == ref.state[ref_params[0]]["step"].item() == 3
    assert len(amp.state_dict()["state"]) == len(ref.state_dict()["state"]) == len(SHAPES)
    assert all(amp.state_dict()["state"][i] for i in range(len(SHAPES)))
    assert_states_close(ref, ref_params, amp, amp_params, backend)


@pytest.mark.parametrize("how", ["exp_avg = zeros_like(p)", "step = tensor(0.)", "step = tensor([0.])",
                                 "exp_avg_sq = its clone"])
def test_assigning_a_state_tensor_is_what_the_next_step_reads_like_torch(backend, device, how):
    """``opt.state[p]["exp_avg"] = torch.zeros_like(p)`` (a moment reset for a re-initialised layer) or
    a new ``step``: torch's AdamW reads the assigned tensor from then on. ampfused copies it into its
    flat state at the next step and points the entry back there, so the step reads the new values and
    ``opt.state`` shows what the steps wrote (not a tensor that stopped moving)."""
    def assign(opt, params):
        state = opt.state[params[0]]
        if how.startswith("exp_avg ="):
            state["exp_avg"] = torch.zeros_like(params[0])
        elif how.startswith("step"):
            state["step"] = torch.tensor([0.0]) if "[" in how else torch.tensor(0.0)
        else:
            state["exp_avg_sq"] = state["exp_avg_sq"].clone()

    (ref, ref_params), (amp, amp_params) = _beside_torch(backend, device, steps=5, change_at=2, change=assign)
    assert amp.state[amp_params[0]]["step"].item() == ref.state[ref_params[0]]["step"].item()
    # (torch keeps an assigned [1]-shaped step as it is; ampfused's steps stay 0-d views of one flat buffer)
    keys = ("exp_avg", "exp_avg_sq") if "[" in how else STATE_KEYS
    assert_states_close(ref, ref_params, amp, amp_params, backend, keys=keys)
    first, second = (amp.state[p]["exp_avg_sq"].untyped_storage().data_ptr() for p in amp_params[:2])
    assert first == second, "the assigned tensor was stepped in place of the optimizer's flat state"


def test_a_low_precision_param_unfrozen_after_construction_accumulates_in_fp32(backend, device):
    """Gradual unfreezing: build the optimizer over the whole model with the backbone frozen, unfreeze it
    later. DESIGN §3: p.grad of a bf16 param must be the fp32, in-order sum of the micro-batches; a param
    frozen when the optimizer was built gets no accumulation hook and keeps bf16 gradients forever."""
    model = mlp(6, 5, 3, dtype=torch.bfloat16, device=device)
    model[0].requires_grad_(False)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(k)).to(device=device, dtype=torch.bfloat16) for k in range(4)]
    model(xs[0]).float().square().sum().backward()
    opt.step()
    opt.zero_grad()
    model[0].requires_grad_(True)  # unfreeze the backbone
    oracle = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device=device, dtype=torch.bfloat16)
    oracle.load_state_dict(model.state_dict())
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in oracle.parameters()]
    for x in xs[1:]:
        model(x).float().square().sum().backward()
        oracle.zero_grad()
        oracle(x).float().square().sum().backward()
        for e, p in zip(expected, oracle.parameters()):
            e.add_(p.grad.float())
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, f"{name}: p.grad is {p.grad.dtype}, not the fp32 accumulated gradient"
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.grad, e)


def test_tensor_betas_are_accepted_like_torch(backend, device):
    """torch.optim.AdamW takes betas as a pair of tensors (and ampfused steps them fine once they arrive
    through load_state_dict), but FusedAmpAdamW's constructor refuses them."""
    base = make_params(SHAPES, device=device)
    ref_params, amp_params = clone_params(base), clone_params(base)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)))
    amp = ampfused.FusedAmpAdamW(amp_params, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)), backend=backend)
    for step in range(3):
        for opt, params in ((ref, ref_params), (amp, amp_params)):
            for p, g in zip(params, random_grads(base, step)):
                p.grad = g.clone()
            opt.step()
    assert_states_close(ref, ref_params, amp, amp_params, backend)


def test_resuming_a_torch_adamw_checkpoint_does_not_depend_on_the_load_order(backend, device):
    """A bf16 model resumed from a torch.optim.AdamW checkpoint (no master_param in it). With torch,
    ``opt.load_state_dict`` then ``model.load_state_dict`` is as good as the other order. ampfused
    creates the fp32 masters from the params at load time, so in that order the masters hold the
    pre-load weights and the first step overwrites the loaded model with them."""
    torch.manual_seed(0)
    src = torch.nn.Linear(4, 3).to(device=device, dtype=torch.bfloat16)
    torch_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    x = torch.randn(5, 4).to(device=device, dtype=torch.bfloat16)
    for _ in range(3):
        src(x).float().square().sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    model_sd, opt_sd = through_disk(src.state_dict()), through_disk(torch_opt.state_dict())
    results = []
    for order in ("model first", "optimizer first"):
        torch.manual_seed(1)  # fresh weights, as a resumed script builds them
        model = torch.nn.Linear(4, 3).to(device=device, dtype=torch.bfloat16)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
        load_in_order(model, opt, model_sd, opt_sd, order)
        model(x).float().square().sum().backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg="the loaded weights were replaced by the pre-load ones")


# ------------------------------------------------------------------------------------------ loops that match


SCHEDULERS = {
    "StepLR": lambda o: lr_scheduler.StepLR(o, 2, 0.5),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.1], total_steps=20),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, 10),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, 0.1, total_iters=3), lr_scheduler.CosineAnnealingLR(o, 10)], milestones=[3]),
    "hf_cosine_with_warmup": lambda o: pytest.importorskip("transformers").get_cosine_schedule_with_warmup(o, 3, 12),
}


@pytest.mark.parametrize("schedule", [*SCHEDULERS, "by hand + add_param_group", "tensor lr + OneCycleLR"])
def test_unused_frozen_and_no_decay_groups_with_schedulers_match_torch(backend, device, schedule):
    """Unused branch (grad None), frozen head, decay/no-decay groups with their own lr, set_to_none
    alternating, and the lr schedule: params, state, step counters and group hyperparameters as torch."""
    ref_model, model = twin_nets(device)
    lr = torch.tensor(0.01) if schedule.startswith("tensor") else 0.01
    ref = torch.optim.AdamW(decay_groups(ref_model, 0.01), lr=lr, weight_decay=0.1)
    opt = ampfused.FusedAmpAdamW(decay_groups(model, 0.01), lr=copy.deepcopy(lr), weight_decay=0.1, backend=backend)
    make = SCHEDULERS.get(schedule, (lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20)) if schedule.startswith("tensor") else None)
    schedulers = [make(o) if make else None for o in (ref, opt)]
    by_hand = schedule.startswith("by hand")
    for step in range(8):
        if by_hand and step == 4:
            for o, m in ((ref, ref_model), (opt, model)):
                o.add_param_group({"params": list(m.branch.parameters()), "lr": 0.003, "weight_decay": 0.3})
        for o, m, s in ((ref, ref_model, schedulers[0]), (opt, model, schedulers[1])):
            net_loss(m, step, device, use_branch=by_hand and step >= 4 and step % 2 == 0).backward()
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
            if s is not None:
                s.step()
            if by_hand:
                for g in o.param_groups:
                    g["lr"] *= 0.9
                    g["weight_decay"] *= 1.1
    assert_like_torch(ref, ref_model, opt, model, backend)
    assert not opt.state[model.head.weight] and (by_hand or not opt.state.get(model.branch.weight))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("route", ["ampfused->ampfused", "torch->ampfused", "ampfused->torch"])
def test_resume_mid_training_through_torch_save_matches_an_uninterrupted_torch_run(backend, device, route, amsgrad):
    def train(m, o, steps):
        for step in steps:
            net_loss(m, step, device, use_branch=step % 2 == 0).backward()
            o.step()
            o.zero_grad()

    def make(cls, m):
        kwargs = {"backend": backend} if cls is ampfused.FusedAmpAdamW else {}
        return cls(m.parameters(), lr=1e-2, amsgrad=amsgrad, **kwargs)

    src_cls, dst_cls = (ampfused.FusedAmpAdamW if side == "ampfused" else torch.optim.AdamW for side in route.split("->"))
    ref_model, first = twin_nets(device)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, amsgrad=amsgrad)
    train(ref_model, ref, range(10))
    first_opt = make(src_cls, first)
    train(first, first_opt, range(5))
    model_sd, opt_sd = through_disk(first.state_dict()), through_disk(first_opt.state_dict())
    _, resumed = twin_nets(device, seed=1)
    resumed.load_state_dict(model_sd)
    resumed_opt = make(dst_cls, resumed)
    resumed_opt.load_state_dict(opt_sd)
    train(resumed, resumed_opt, range(5, 10))
    tolerance = "reference" if dst_cls is torch.optim.AdamW and src_cls is torch.optim.AdamW else backend
    assert_like_torch(ref, ref_model, resumed_opt, resumed, tolerance)


def test_failed_load_of_a_state_dict_from_before_add_param_group_changes_nothing(backend, device):
    ref_model, model = twin_nets(device)
    opts = []
    for cls, m in ((torch.optim.AdamW, ref_model), (ampfused.FusedAmpAdamW, model)):
        kwargs = {"backend": backend} if cls is ampfused.FusedAmpAdamW else {}
        o = cls([p for n, p in m.named_parameters() if "branch" not in n], lr=1e-2, **kwargs)
        for step in range(2):
            net_loss(m, step, device).backward()
            o.step()
            o.zero_grad()
        old = copy.deepcopy(o.state_dict())
        o.add_param_group({"params": list(m.branch.parameters()), "lr": 3e-3})
        for step in range(2, 4):
            net_loss(m, step, device, use_branch=True).backward()
            o.step()
            o.zero_grad()
        with pytest.raises(ValueError, match="different number of parameter groups"):
            o.load_state_dict(old)
        for step in range(4, 6):
            net_loss(m, step, device, use_branch=True).backward()
            o.step()
            o.zero_grad()
        opts.append(o)
    assert_like_torch(opts[0], ref_model, opts[1], model, backend)


@pytest.mark.parametrize("options", [dict(), dict(amsgrad=True, maximize=True, weight_decay=0.3, eps=1e-3, betas=(0.5, 0.7)),
                                     dict(weight_decay=0), dict(lr=torch.tensor(0.02))], ids=["default", "amsgrad-maximize", "wd0", "tensor-lr"])
@pytest.mark.parametrize("loop", ["closure", "zero_grad(set_to_none=False)"])
def test_closure_and_zero_grad_loops_match_torch(backend, device, loop, options):
    ref_model, model = twin_nets(device)
    ref = torch.optim.AdamW(ref_model.parameters(), **{"lr": 1e-2, **copy.deepcopy(options)})
    opt = ampfused.FusedAmpAdamW(model.parameters(), **{"lr": 1e-2, **copy.deepcopy(options)}, backend=backend)
    losses = {id(ref): [], id(opt): []}
    for step in range(5):
        for o, m in ((ref, ref_model), (opt, model)):
            if loop == "closure":
                def closure(o=o, m=m):
                    o.zero_grad()
                    loss = net_loss(m, step, device)
                    loss.backward()
                    return loss
                losses[id(o)].append(o.step(closure).item())
            else:
                net_loss(m, step, device, use_branch=step == 0).backward()
                o.step()
                o.zero_grad(set_to_none=False)
    assert losses[id(ref)] == pytest.approx(losses[id(opt)], rel=tol(backend)["rtol"] * 10)
    assert_like_torch(ref, ref_model, opt, model, backend)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_bf16_unused_branch_users_clip_and_accumulation_match_the_fp32_master_recipe(backend, device, set_to_none):
    """bf16 model, 3 micro-batches (the branch used in some), clip_grad_norm_(model.parameters(), 1.0),
    decay/no-decay groups; oracle: fp32 masters accumulated by hand, stock clip and AdamW, RNE write-back."""
    model, ref_model = twin_nets(device, dtype=torch.bfloat16)
    named = [(n, p) for n, p in ref_model.named_parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for _, p in named]

    def groups(params):
        return [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

    ref = torch.optim.AdamW(groups(masters), lr=1e-2, weight_decay=0.1)
    live = [p for p in model.parameters() if p.requires_grad]
    opt = ampfused.FusedAmpAdamW(groups(live), lr=1e-2, weight_decay=0.1, backend=backend)
    for step in range(4):
        for k in range(3):
            use_branch = (step + k) % 4 == 1
            net_loss(model, step * 3 + k, device, use_branch).backward()
            net_loss(ref_model, step * 3 + k, device, use_branch).backward()
            for (_, p), m in zip(named, masters):
                if p.grad is not None:
                    m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                    p.grad = None
        for p, m in zip(live, masters):
            assert (p.grad is None) == (m.grad is None)
            if p.grad is not None:
                assert p.grad.dtype == torch.float32 and torch.equal(p.grad, m.grad)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        expected_norm = torch.nn.utils.clip_grad_norm_(masters, 1.0)
        torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
        opt.step()
        ref.step()
        with torch.no_grad():
            for (_, p), m in zip(named, masters):
                p.copy_(m)
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
    for p, m in zip(live, masters):
        amp_state, ref_state = opt.state.get(p, {}), ref.state.get(m, {})
        assert set(amp_state) - {"master_param"} == set(ref_state)
        if ref_state:
            torch.testing.assert_close(amp_state["master_param"], m.detach(), **tol(backend))
            assert torch.equal(p, m.detach().to(torch.bfloat16)) or backend != "reference"
            for key in ref_state:
                torch.testing.assert_close(amp_state[key].float(), ref_state[key].float(), **tol(backend))


# ------------------------------------------------------------------ fp32 accumulation edge cases


def bf16_linear(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 4).to(device=device, dtype=torch.bfloat16)


def fp32_sum_of_backwards(model, xs):
    """The oracle: each micro-batch's bf16 gradients summed in fp32, on a copy of the model."""
    twin = copy.deepcopy(model)
    total = [torch.zeros(p.shape, device=p.device) for p in twin.parameters()]
    for x in xs:
        for p in twin.parameters():
            p.grad = None
        twin(x).float().square().sum().backward()
        for t, p in zip(total, twin.parameters()):
            if p.grad is not None:
                t += p.grad.float()
    return total


def batches(n, device, seed=0):
    return [torch.randn(3, 6, generator=torch.Generator().manual_seed(seed + k)).to(device, torch.bfloat16) for k in range(n)]


def test_a_param_frozen_later_keeps_fp32_storage_through_relayouts_and_unfreezing(backend, device):
    model = bf16_linear(device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
    model.bias.requires_grad_(False)  # frozen after the optimizer was built
    x = batches(3, device)
    model(x[0]).float().square().sum().backward()
    opt.step()  # a memory-format change is not possible on a Linear: a new group re-lays out instead
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device, dtype=torch.bfloat16))]})
    opt.zero_grad()
    model.bias.requires_grad_(True)
    want = fp32_sum_of_backwards(model, x[1:])
    for xb in x[1:]:
        model(xb).float().square().sum().backward()
    for p, w in zip(model.parameters(), want):
        assert p.grad is p.main_grad and torch.equal(p.grad, w)
    assert model.bias.main_grad.untyped_storage().data_ptr() == model.weight.main_grad.untyped_storage().data_ptr()
    opt.step()


def test_frozen_later_params_and_a_memory_format_change_still_step(backend, device):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(device=device, dtype=torch.bfloat16)
    opt = ampfused.FusedAmpAdamW(conv.parameters(), lr=1e-2, backend=backend)
    conv.bias.requires_grad_(False)
    conv.to(memory_format=torch.channels_last)
    conv(torch.randn(2, 3, 5, 5, device=device, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert opt.state[conv.weight]["exp_avg"].stride() == conv.weight.stride()


def test_a_param_frozen_between_forward_and_backward_gets_no_gradient(device):
    model = bf16_linear(device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2)  # alive to the end: it owns the fp32 grads
    x = batches(2, device)
    model(x[0]).float().square().sum().backward()
    before = model.weight.grad.clone()
    loss = model(x[1]).float().square().sum()
    model.weight.requires_grad_(False)  # as AccumulateGrad: a param that no longer requires grad is left alone
    loss.backward()
    assert torch.equal(model.weight.grad, before)
    del opt


def test_a_users_pre_hook_on_the_accumulator_still_sees_every_gradient(device):
    model = bf16_linear(device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2)  # alive to the end: it owns the fp32 grads
    seen = []
    node = torch.autograd.graph.get_gradient_edge(model.weight).node
    node.register_prehook(lambda grads: seen.append(None if grads[0] is None else grads[0].dtype))
    x = batches(3, device)
    want = fp32_sum_of_backwards(model, x)
    for xb in x:
        model(xb).float().square().sum().backward()
    assert seen == [torch.bfloat16] * 3
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    del opt


def test_concurrent_backwards_on_shared_params_lose_no_micro_batch():
    """torch supports backward from several threads on shared leaves (AccumulateGrad locks); so must we."""
    import threading

    p = torch.nn.Parameter(torch.zeros(1 << 18, dtype=torch.bfloat16))
    opt = ampfused.FusedAmpAdamW([p], lr=1e-2)  # alive to the end: it owns the fp32 grads
    p.float().sum().backward()  # the first micro-batch: p.grad is the fp32 view from now on

    def work():
        for _ in range(15):
            p.float().sum().backward()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.grad is p.main_grad and p.grad.min().item() == p.grad.max().item() == 31.0
    del opt


def test_pending_masters_of_a_torch_checkpoint_survive_a_copy_and_a_state_reset(backend, device):
    src = bf16_linear(device, seed=3)
    torch_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    x = batches(1, device)[0]
    src(x).float().square().sum().backward()
    torch_opt.step()
    for reset in (False, True):
        model = bf16_linear(device, seed=1)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
        opt.load_state_dict(through_disk(torch_opt.state_dict()))
        model.load_state_dict(src.state_dict())  # after the optimizer's: the masters must come from these
        model, opt = copy.deepcopy((model, opt))
        if reset:
            del opt.state[model.bias]
            model.bias.requires_grad_(False)
        model(x).float().square().sum().backward()
        opt.step()
        for p, q in zip(model.parameters(), src.parameters()):
            assert (p.float() - q.float()).abs().max().item() < 0.05, "the loaded weights were replaced"
        assert opt.state_dict()["state"]


def test_tensor_betas_changed_in_place_are_read_again(backend, device):
    base = make_params(SHAPES, device=device)
    ref_params, amp_params = clone_params(base), clone_params(base)
    ref_betas, amp_betas = (torch.tensor(0.9), torch.tensor(0.99)), (torch.tensor(0.9), torch.tensor(0.99))
    ref = torch.optim.AdamW(ref_params, lr=1e-2, betas=ref_betas)
    amp = ampfused.FusedAmpAdamW(amp_params, lr=1e-2, betas=amp_betas, backend=backend)
    for step in range(4):
        if step == 2:
            for b in ref_betas + amp_betas:
                b.fill_(0.5)
        for opt, params in ((ref, ref_params), (amp, amp_params)):
            for p, g in zip(params, random_grads(base, step)):
                p.grad = g.clone()
            opt.step()
    assert_states_close(ref, ref_params, amp, amp_params, backend)
