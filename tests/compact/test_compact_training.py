"""Training parity of the compact step (ampfused._compact.compact_adamw_step_) with torch.optim.AdamW
on fp32 masters, on a small noisy linear regression with a bf16 weight matrix and bias.

split16 with fp32 moments must be the fp32-master run bit for bit (the masters get the tie rule,
the one place split16 departs from fp32, applied after each torch step); the lossy modes must end
within a stated tolerance of its final loss.
"""
import functools

import pytest
import torch

from ampfused import _compact as C

STEPS = 200
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def problem(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 80, generator=g)
    w_true = torch.randn(64, 80, generator=g) / 8
    y = x @ w_true.T + 0.05 * torch.randn(512, 64, generator=g)
    weight = (torch.randn(64, 80, generator=g) / 8).to(dtype)  # 5120 elements, rows of 80: int8 / int4 moments apply
    bias = torch.zeros(64, dtype=dtype)  # 64 elements: stays fp32 under "int8" / "int4"
    return x, y, [weight, bias]


def loss_and_grads(x, y, params):
    """MSE loss at the (16-bit) params, with fp32 gradients computed by autograd in fp32."""
    w, b = (p.detach().float().requires_grad_() for p in params)
    loss = ((x @ w.T + b - y) ** 2).mean()
    loss.backward()
    return loss.detach(), [w.grad, b.grad]


@functools.lru_cache(maxsize=None)  # the tests only read the result
def run_torch(amsgrad=False, tie_rule=True, dtype=torch.bfloat16):
    """torch.optim.AdamW on fp32 masters; the 16-bit params are RNE of the masters after every step."""
    x, y, params = problem(dtype)
    masters = [p.float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, foreach=False, amsgrad=amsgrad, betas=(HYPER["beta1"], HYPER["beta2"]),
                            lr=HYPER["lr"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    ties = 0
    for _ in range(STEPS):
        _, grads = loss_and_grads(x, y, params)
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                if tie_rule:
                    ties += int(((C._bits(m) & 0xFFFF) == 0x8000).sum())
                    m.copy_(C.join16(*C.split16(m)))
                p.copy_(m.to(p.dtype))
    return loss_and_grads(x, y, params)[0], params, masters, opt, ties


def run_compact(master_weights, state_dtype, amsgrad=False, stochastic=False, dtype=torch.bfloat16):
    x, y, params = problem(dtype)
    states = [C.init_state(p, master_weights, state_dtype, amsgrad) for p in params]
    for _ in range(STEPS):
        _, grads = loss_and_grads(x, y, params)
        for p, g, st in zip(params, grads, states):
            C.compact_adamw_step_(p, g, st, amsgrad=amsgrad, stochastic_rounding=stochastic, **HYPER)
    return loss_and_grads(x, y, params)[0], params, states


@pytest.mark.slow
@pytest.mark.parametrize("amsgrad", [False, True])
def test_split16_is_the_fp32_master_run_bitwise(amsgrad):
    loss, params, masters, opt, ties = run_torch(amsgrad)
    c_loss, c_params, states = run_compact("split16", torch.float32, amsgrad)
    for p, m, cp, st in zip(params, masters, c_params, states):
        assert torch.equal(cp.view(torch.int16), p.view(torch.int16))
        decoded = C.decode_state(st, cp)
        ref = opt.state[m]
        assert torch.equal(C._bits(decoded["master_param"]), C._bits(m.detach()))
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert torch.equal(C._bits(decoded[key]), C._bits(ref[key])), key
        assert decoded["step"] == ref["step"] == STEPS
    assert c_loss == loss
    assert ties > 0, "the run must have produced ties, so that the tie rule was exercised"


# (master_weights, state_dtype, stochastic, param dtype): relative tolerance on the final loss
# (the gate is 1%; a bf16 param without master, even rounded stochastically, gets 2%)
LOSSY = [
    ("split8", torch.float32, False, torch.bfloat16, 0.01),
    ("split8", torch.float32, False, torch.float16, 0.01),
    ("fp32", torch.bfloat16, False, torch.bfloat16, 0.01),
    ("fp32", torch.bfloat16, True, torch.bfloat16, 0.01),
    ("fp32", "int8", False, torch.bfloat16, 0.01),
    ("split8", "int8", False, torch.bfloat16, 0.01),
    ("split8", "int8", False, torch.float16, 0.01),
    ("split16", "int8", False, torch.bfloat16, 0.01),
    ("none", torch.bfloat16, True, torch.bfloat16, 0.02),
    # int4: the regression trains to its noise floor, where the exp_avg grid's steps decide (docs/results/int4-grids.md)
    ("fp32", "int4", False, torch.bfloat16, 0.01),
    ("split16", "int4", False, torch.bfloat16, 0.01),
    ("split8", "int4", False, torch.float16, 0.01),
    ("none", "int4", True, torch.bfloat16, 0.02),
]


@pytest.mark.slow
@pytest.mark.parametrize("master_weights,state_dtype,stochastic,dtype,rtol", LOSSY,
                         ids=[f"{a}-{b}-{'sr' if c else 'rne'}-{d}".replace("torch.", "")
                              for a, b, c, d, _ in (getattr(row, "values", row) for row in LOSSY)])
def test_lossy_modes_reach_the_fp32_loss(master_weights, state_dtype, stochastic, dtype, rtol):
    reference, *_ = run_torch(tie_rule=False, dtype=dtype)
    torch.manual_seed(0)
    loss, params, _ = run_compact(master_weights, state_dtype, stochastic=stochastic, dtype=dtype)
    start = loss_and_grads(*problem(dtype))[0]
    assert reference < start / 5, "the problem must actually train"
    assert abs(loss - reference) <= rtol * reference, f"final loss {loss.item():.6g} vs fp32 masters {reference.item():.6g}"


@pytest.mark.slow
def test_bf16_params_without_master_stall_where_stochastic_rounding_does_not():
    """The reason stochastic rounding exists: with RNE, updates under half a bf16 ulp are lost."""
    torch.manual_seed(0)
    rne, *_ = run_compact("none", torch.float32, stochastic=False)
    torch.manual_seed(0)
    sr, *_ = run_compact("none", torch.float32, stochastic=True)
    reference, *_ = run_torch(tie_rule=False)
    assert abs(sr - reference) < abs(rne - reference)


@pytest.mark.parametrize("amsgrad,maximize,tensor_lr", [(False, False, False), (True, True, True)])
def test_step_math_is_the_reference_backends(amsgrad, maximize, tensor_lr):
    """With an fp32 master and fp32 moments the compact step is ampfused.reference's update, bit for bit."""
    from ampfused import reference
    from ampfused.functional import Hyper

    torch.manual_seed(0)
    param = torch.randn(33, 17).to(torch.bfloat16)
    lr = torch.tensor(3e-3) if tensor_lr else 3e-3
    hyper = Hyper(lr, 0.9, 0.99, 1e-6, 0.05, amsgrad, maximize)
    state = C.init_state(param, "fp32", torch.float32, amsgrad)
    p_ref, ref = param.clone(), {k: v.clone() for k, v in state.items()}
    factor = torch.tensor(0.37)
    for _ in range(5):
        grad = torch.randn(33, 17)
        C.compact_adamw_step_(param, grad, state, lr=lr, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05,
                              amsgrad=amsgrad, maximize=maximize, factor=factor, skip=torch.tensor(0.0))
        reference._adamw_one(p_ref, grad, ref["exp_avg"], ref["exp_avg_sq"], ref.get("max_exp_avg_sq"), ref["step"],
                             ref["master_param"], hyper, factor, torch.tensor(False))
    assert torch.equal(param.view(torch.int16), p_ref.view(torch.int16))
    for key, value in ref.items():
        assert torch.equal(C._bits(state[key]), C._bits(value)), key
