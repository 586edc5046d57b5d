"""Seeded fault-injection fuzz: inf/NaN at random steps, micro-batches, params, positions
and dtypes, through the real autograd + hook + GradScaler path, against an independent oracle
(torch.optim.AdamW on fp32 masters + the scaler rules in plain Python) that skips exactly the steps
whose gradients hold a non-finite value, natural fp16 overflows included.

Invariants checked at every step: a skipped step changes no param/state bit; low-precision params
are the RNE rounding of their master; every state tensor is finite; ``step`` counts the good steps;
the scale follows the rules. Every backend runs 1000 steps, except Triton on a CPU machine: its
interpreter takes ~0.3 s a step, so it runs 40 steps there (1000 on a GPU).
"""
import math
import random

import pytest
import torch

import ampfused
from helpers import snapshot

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(3, 4), (5,), (2, 2, 2), (1,), (7,), (4, 3)]
BAD = (math.inf, -math.inf, math.nan)
SCALER = dict(init_scale=2.0**6, growth_factor=2.0, backoff_factor=0.5, growth_interval=4, hysteresis=2, min_scale=2.0**-4)
CLIP = 3.0


def expected_scale(scale, good, left, found):
    """The GradScaler rules (class docstring) in plain Python."""
    if found:
        good, left = 0, left - 1
        if left <= 0:
            scale = max(scale * SCALER["backoff_factor"], SCALER["min_scale"])
    else:
        good += 1
        if good == SCALER["growth_interval"]:
            good, left, scale = 0, SCALER["hysteresis"], scale * SCALER["growth_factor"]
    return scale, good, left


def steps_for(backend):
    return 40 if backend == "triton" and not torch.cuda.is_available() else 1000


@pytest.mark.parametrize("seed", [0])
def test_fault_injection_fuzz(backend, device, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtypes = [DTYPES[i % 3] for i in range(len(SHAPES))]
    params = [torch.randn(s, generator=gen).to(device=device, dtype=d).requires_grad_() for s, d in zip(SHAPES, dtypes)]
    groups = [dict(params=params[:3], lr=1e-2, weight_decay=0.1, amsgrad=True),
              dict(params=params[3:], lr=3e-3, betas=(0.8, 0.99), weight_decay=0.0)]
    opt = ampfused.FusedAmpAdamW(groups, max_grad_norm=CLIP, backend=backend)
    scaler = ampfused.GradScaler(device.type, **SCALER, collapse_threshold=None)

    # oracle: fp32 masters stepped by torch.optim.AdamW, grads built with the same casts as autograd
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    oracle = torch.optim.AdamW([dict(g, params=masters[:3] if i == 0 else masters[3:]) for i, g in enumerate(groups)], foreach=False)
    scale, good, left = SCALER["init_scale"], 0, SCALER["hysteresis"]
    good_steps = skipped = injected = natural = 0

    for step in range(steps_for(backend)):
        micro_batches = rng.randint(1, 3)
        coeffs = [[torch.randn(s, generator=gen) * rng.choice((0.1, 1.0, 1.0, 40.0, 40.0, 3000.0)) for s in SHAPES] for _ in range(micro_batches)]
        inject = rng.random() < 0.15
        if inject:  # one or more poisoned elements, anywhere
            for _ in range(rng.choice((1, 1, 1, 2, 5))):
                mb, i = rng.randrange(micro_batches), rng.randrange(len(SHAPES))
                coeffs[mb][i].view(-1)[rng.randrange(coeffs[mb][i].numel())] = rng.choice(BAD)
        # the model: loss = sum_i <p_i, c_i>, so autograd's grad of p_i is (S * c_i) cast to p_i's dtype
        for mb in range(micro_batches):
            loss = sum((p.float() * c.to(device)).sum() for p, c in zip(params, coeffs[mb]))
            scaler.scale(loss).backward()
        # oracle gradients: fp32 params accumulate in p.grad, low-precision ones in an fp32 main_grad
        S = torch.tensor(scale, dtype=torch.float32)
        grads = []
        for i, d in enumerate(dtypes):
            acc = torch.zeros(SHAPES[i])
            for mb in range(micro_batches):
                acc += (S * coeffs[mb][i]).to(d) if d != torch.float32 else S * coeffs[mb][i]
            grads.append(acc)
        found = not all(torch.isfinite(g).all() for g in grads)
        skipped += found
        injected += inject
        natural += found and not inject

        if rng.random() < 0.3:
            scaler.unscale_(opt)
        before = snapshot(opt, params)
        scaler.step(opt)
        scaler.update()

        if found:
            for p in params:  # the poisoned accumulators are not state
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()
            after = snapshot(opt, params)
            for key in before:
                xs, ys = (before[key], after[key]) if key == "params" else ([before[key]], [after[key]])
                for x, y in zip(xs, ys):
                    assert torch.equal(x.reshape(-1).view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8),
                                       y.reshape(-1).view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8)), \
                        f"step {step}: skipped step changed {key}"
            assert not torch.isfinite(opt.grad_norm), f"step {step}: grad_norm must be non-finite on a skip"
        else:
            good_steps += 1
            inv_scale = S.double().reciprocal().float()
            for m, g in zip(masters, grads):
                m.grad = g * inv_scale
            torch.nn.utils.clip_grad_norm_(masters, CLIP)
            oracle.step()
        scale, good, left = expected_scale(scale, good, left, found)
        assert scaler.get_scale() == scale, f"step {step}: scale {scaler.get_scale()} != rule {scale}"

        for i, p in enumerate(params):
            state = opt.state[p]
            if not state:
                continue
            assert state["step"].item() == good_steps, f"step {step}: param {i} step counter"
            for key, value in state.items():
                assert torch.isfinite(value).all(), f"step {step}: param {i} state {key} is not finite"
            if dtypes[i] != torch.float32:
                assert torch.equal(p.detach(), state["master_param"].to(dtypes[i])), f"step {step}: param {i} != RNE(master)"
        opt.zero_grad(set_to_none=rng.random() < 0.5)

    # the run equals the oracle that skipped exactly the same steps
    tol = dict(rtol=1e-5, atol=1e-6) if backend == "reference" else dict(rtol=1e-4, atol=1e-5)
    for i, (p, m) in enumerate(zip(params, masters)):
        state = opt.state[p]
        weights = state.get("master_param", p.detach())
        torch.testing.assert_close(weights.float().cpu(), m.detach(), **tol, msg=f"param {i} weights")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                torch.testing.assert_close(state[key].cpu(), oracle.state[m][key], **tol, msg=f"param {i} {key}")
    assert scaler.skipped_steps == skipped
    assert injected > 0.05 * steps_for(backend), injected  # the fuzz really fuzzed
    assert natural > 0 or steps_for(backend) < 1000, "no natural fp16 overflow in 1000 steps"
