"""FusedAmpAdamW in the compact modes (DESIGN §9), on every backend: split16 is the fp32-master run
bit for bit, each lossy mode is the reference backend's run of the same mode, and the functional API
steps compact state as the optimizer does.

A backend that lists a mode in its ``COMPACT_MODES`` runs it natively and is held
to its own fp32 run (split16) or within a stated tolerance of the reference (lossy modes); any
other backend hands those tensors to the reference passes inside its step (the fallback), so its
compact tensors must equal the reference backend's bit for bit.
"""
import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused._contract import compact_modes
from ampfused._state import master_of, moment_key
from helpers import DEVICE, OPT_LOSSY, OPT_SCALE, OPT_SIZES, clone_parameters, feed, full_state, opt_params
from helpers import equal_bits, run_steps, serves_natively, tol


@pytest.mark.parametrize("amsgrad", [False, True])
def test_split16_is_the_fp32_master_run_bitwise(backend, amsgrad):
    own = serves_natively(backend, {"split16"})
    fp32_backend = backend if own else "reference"
    # clipping moves the factor with the norm, whose last bits depend on the backend's summation
    # order: it is active only where both runs sum on the same backend
    clip = 1.0 if own or backend == "reference" else 1e9
    a = opt_params()
    b = clone_parameters(a)
    fp32 = ampfused.FusedAmpAdamW(a, lr=1e-2, amsgrad=amsgrad, max_grad_norm=clip, backend=fp32_backend)
    split = ampfused.FusedAmpAdamW(b, lr=1e-2, amsgrad=amsgrad, max_grad_norm=clip, master_weights="split16",
                                   backend=backend)
    ties = 0
    for step in range(12):
        for opt, params in ((fp32, a), (split, b)):
            feed(opt, params, step, bad=step == 5)
            opt.step()
        if step == 5:
            assert not torch.isfinite(split.grad_norm)
        for p in a:  # the tie rule, the one place split16 departs from fp32 masters, applied to the fp32 run
            master = fp32.state[p]["master_param"]
            nudged = C.join16(*C.split16(master))
            ties += int((nudged != master).sum())
            master.copy_(nudged)
        for p, q in zip(a, b):
            s, t = fp32.state[p], split.state[q]
            assert torch.equal(p, q), f"step {step}: params differ"
            assert torch.equal(C.join16(q.detach(), t["master_low16"]), s["master_param"]), f"step {step}: masters differ"
            for key in ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
                assert torch.equal(s[key], t[key]), f"step {step}: {key} differs"
    assert ties < 10  # a tie is a 2^-16 event per element and step


@pytest.mark.parametrize("rounded_up", [False, True])
def test_split16_ties_through_the_optimizer(backend, rounded_up):
    """fp32 masters whose low half is exactly 0x8000, loaded into split16: the param stays RNE of the
    master, which moves by one fp32 ulp toward the param; the next step is the fp32 run's from there."""
    g = torch.Generator().manual_seed(3)
    n = OPT_SIZES[0]
    high = torch.randint(0x3C00, 0x3F00, n, generator=g, dtype=torch.int64)
    high = high | 1 if rounded_up else high & ~1  # an odd high half rounds up at a tie, an even one down
    master = C._from_bits((high << 16) | 0x8000).to(DEVICE)
    p = torch.nn.Parameter(master.to(torch.bfloat16))
    opt = ampfused.FusedAmpAdamW([p], lr=1e-2, master_weights="split16", backend=backend)
    zeros = torch.zeros(n, device=DEVICE)
    fp32_form = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": zeros + 0.01, "exp_avg_sq": zeros + 1e-4,
                               "master_param": master.clone()}},
                 "param_groups": opt.state_dict()["param_groups"]}
    opt.load_state_dict(fp32_form)
    low = opt.state[p]["master_low16"]
    stored = C.join16(p.detach(), low)
    assert torch.equal(p.detach(), master.to(torch.bfloat16))
    assert torch.equal(stored.to(torch.bfloat16), p.detach())
    ulps = C._bits(stored) - C._bits(master)
    assert torch.equal(ulps, torch.full_like(ulps, 1 if rounded_up else -1))

    q = torch.nn.Parameter(p.detach().clone())
    own = serves_natively(backend, {"split16"})
    fp32 = ampfused.FusedAmpAdamW([q], lr=1e-2, backend=backend if own else "reference")
    fp32_form["state"][0]["master_param"] = stored.clone()
    fp32.load_state_dict(fp32_form)
    for opt_, params in ((opt, [p]), (fp32, [q])):
        feed(opt_, params, 0)
        opt_.step()
    assert torch.equal(p, q)
    assert torch.equal(C.join16(p.detach(), opt.state[p]["master_low16"]), C.join16(*C.split16(fp32.state[q]["master_param"])))


LOSSY_STEPS = 6


@pytest.mark.parametrize("master_weights,state_dtype,stochastic", [m + (False,) for m in OPT_LOSSY] + [
    (False, torch.bfloat16, True), ("split8", torch.bfloat16, True)])
def test_lossy_mode_is_the_reference_run_of_that_mode(backend, master_weights, state_dtype, stochastic):
    kw = dict(lr=1e-2, amsgrad=True, master_weights=master_weights, state_dtype=state_dtype,
              stochastic_rounding=stochastic, max_grad_norm=1e9)
    runs = []
    for name in (backend, "reference"):
        params = opt_params()
        opt = ampfused.FusedAmpAdamW(params, backend=name, **kw)
        torch.manual_seed(7)  # the rounding seeds
        run_steps(opt, params, LOSSY_STEPS)  # step 4 has an inf: a skip inside the run
        runs.append((opt, params))
    (opt, params), (ref, ref_params) = runs
    # a native variant: fp32 arithmetic in another order (and its own random bits) moves a code or a
    # bf16 ulp here and there; the decoded state stays within the encodings' resolution
    # a param without master under SR is rounded with other random bits at each of the steps: the
    # two runs walk apart by up to one bf16 ulp (2^-7 relative) per step
    rtol = LOSSY_STEPS * 2**-7 if stochastic and master_weights is False else 2e-2
    for p, q, s, t in zip(params, ref_params, full_state(opt, params), full_state(ref, ref_params)):
        state = opt.state[p]
        assert state.keys() == ref.state[q].keys()
        # each tensor by the encodings it needs: a small tensor keeps fp32 moments under "int8" / "int4"
        # (and its split master, which the backend may serve natively)
        needed = compact_modes(p, state[moment_key(state, "exp_avg")], master_of(state), stochastic)
        if needed and not serves_natively(backend, needed):
            assert torch.equal(p, q)  # served by the reference passes: the same bits
            for key in state:  # (split16's low halves read as bf16 may be NaN patterns: compared as bits)
                assert equal_bits(state[key], ref.state[q][key]), key
        elif not needed:  # fp32 state: the backend's own kernel steps it
            torch.testing.assert_close(p.float(), q.float(), rtol=2**-7, atol=0)  # one bf16 ulp
            for key in state:
                torch.testing.assert_close(state[key], ref.state[q][key], **tol(backend), msg=key)
        else:
            torch.testing.assert_close(p.float(), q.float(), rtol=rtol, atol=1e-3)
            for key in s:
                # with SR the two runs' moments take other random roundings at each step: up to a bf16 ulp a step of
                # the tensor's scale apart (an element near zero has a tiny ulp but inherits the earlier ones)
                atol = LOSSY_STEPS * 2**-8 * t[key].float().abs().max().item() if stochastic else 1e-6
                torch.testing.assert_close(s[key].float(), t[key].float(), rtol=1.5e-1, atol=atol, msg=key)


def test_functional_api_steps_compact_state_as_the_optimizer():
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(clone_parameters(params), lr=1e-2, master_weights="split8", state_dtype="int8", backend="reference")
    run_steps(opt, opt.param_groups[0]["params"], 1, bad_steps=())
    state = [C.init_state(p.detach(), "split8", "int8") for p in params]
    feed(opt, params, 0)
    ampfused.functional.fused_amp_adamw(
        [p.detach() for p in params], [p.grad for p in params],
        [s.get("exp_avg_codes", s.get("exp_avg")) for s in state], [s.get("exp_avg_sq_codes", s.get("exp_avg_sq")) for s in state],
        [None] * 3, [s["step"] for s in state], [s["master_residual8"] for s in state],
        moment_scales=[(s["exp_avg_scales"], s["exp_avg_sq_scales"], None) if "exp_avg_scales" in s else None for s in state],
        grad_scale=torch.tensor(OPT_SCALE), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, backend="cpu")
    for p, q, s in zip(params, opt.param_groups[0]["params"], state):
        assert torch.equal(p, q)
        for key, value in s.items():
            assert torch.equal(value, opt.state[q][key]), key

