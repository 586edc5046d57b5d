"""int4 moments (``state_dtype="int4"``, DESIGN §9) through the optimizer on every backend: exp_avg_sq
never decodes to 0 beside a huge element of its block (the zero-point problem), so the update stays
bounded; int8 and int4 checkpoints are not converted into each other silently; a skipped step writes nothing."""
import copy

import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused.checkpoint import to_torch_state_dict
from helpers import DEVICE, assert_bitwise_equal, clone_parameters, feed, full_state, opt_params, run_steps, same_bits
from helpers import snapshot

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SHAPE = (16, 512)  # two blocks per row, an even last dimension: int4 moments ([note: int4 packing])


def torch_form(opt, state: dict) -> dict:
    """A torch.optim.AdamW state dict of ``opt``'s one param holding ``state`` (fp32 tensors)."""
    return {"state": {0: state}, "param_groups": opt.state_dict()["param_groups"]}


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, "fp32"), (torch.bfloat16, "split16")])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_exp_avg_sq_never_decodes_to_zero_beside_a_huge_element(backend, dtype, master_weights, amsgrad):
    """The zero-point problem (Li et al. 2023): one huge exp_avg_sq element beside tiny ones, under a
    non-zero exp_avg. A grid with 0 would decode the tiny ones to v = 0 and move them by lr m / eps;
    the sqrt grid's smallest level keeps every sqrt(v) at or above ``min(LEVELS) * block max``, which
    bounds each step: ``|dw| <= lr / bc1 * |m_new| / (sqrt(beta2) min(LEVELS) max sqrt(v) / bc2 + eps)``."""
    lr, beta1, beta2, eps = 0.1, 0.9, 0.999, 1e-8
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(SHAPE, generator=g) * 1e-2).to(dtype).to(DEVICE))
    opt = ampfused.FusedAmpAdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=0.0, amsgrad=amsgrad,
                                 master_weights=master_weights, state_dtype="int4", backend=backend)
    v = torch.full(SHAPE, 1e-12)
    v[0, 0] = 1e4  # block 0 of row 0: sqrt(v) of 100 beside 1e-6 (y = 1e-8, below every level but the first)
    v[5, 300] = 1.0  # and block 1 of row 5
    m = torch.where(torch.rand(SHAPE, generator=g) < 0.5, -1e-3, 1e-3)
    state = {"step": torch.tensor(10.0), "exp_avg": m, "exp_avg_sq": v}
    if amsgrad:
        state["max_exp_avg_sq"] = v.clone()
    opt.load_state_dict(torch_form(opt, {k: t.to(DEVICE) for k, t in state.items()}))
    assert opt.state[p]["exp_avg_sq_codes"].dtype == torch.uint8  # int4 codes, not fp32 moments

    smallest = min(C.INT4_GRIDS["sqrt"][0])
    assert smallest > 0, "the sqrt grid has no zero level"
    for step in range(3):
        before = full_state(opt, [p])[0]
        decoded_v = before["exp_avg_sq"].cpu()
        assert (decoded_v > 0).all(), f"step {step}: an exp_avg_sq decodes to 0"
        # every element at or above the smallest level of its block's maximum (fp32 roundings aside)
        block_max = decoded_v.sqrt().reshape(SHAPE[0], -1, C.BLOCK).amax(dim=-1, keepdim=True)
        floor = (smallest * block_max * (1 - 2 ** -20)).expand(-1, -1, C.BLOCK).reshape(SHAPE)
        assert (decoded_v.sqrt() >= floor).all(), f"step {step}: a sqrt(v) below the smallest level"
        w = before.get("master_param", p.detach().float()).cpu()
        grad = torch.randn(SHAPE, generator=g) * 1e-4
        p.grad = grad.to(dtype).to(DEVICE)
        opt.step()
        after = full_state(opt, [p])[0]
        w_new = after.get("master_param", p.detach().float()).cpu()
        t = step + 11
        bc1, bc2_sqrt = 1 - beta1 ** t, (1 - beta2 ** t) ** 0.5
        m_new = beta1 * before["exp_avg"].cpu().abs() + (1 - beta1) * p.grad.float().cpu().abs()
        bound = lr / bc1 * m_new / (beta2 ** 0.5 * floor / bc2_sqrt + eps)
        moved = (w_new - w).abs()
        assert torch.isfinite(w_new).all(), f"step {step}: a non-finite weight"
        # (the fp32 update's own rounding: an ulp of the weight and of the bound)
        slack = 2 ** -22 * (w.abs() + bound)
        assert (moved <= bound * (1 + 1e-5) + slack).all(), \
            f"step {step}: an update of {(moved - bound).max().item():.3g} beyond the bound"
        # without the floor the tiny elements beside the huge one would move by lr m / eps: 10^4 at this m
        assert bound[0, :C.BLOCK].max().item() < 1e-3 * lr * 1e-3 / eps
        assert (after["exp_avg_sq"] > 0).all()


@pytest.mark.parametrize("saved_as,loaded_as", [("int8", "int4"), ("int4", "int8")])
def test_int8_and_int4_checkpoints_are_not_converted_silently(backend, saved_as, loaded_as):
    """Loading one blockwise encoding into the other is refused before any write, naming
    to_torch_state_dict; its fp32 form loads, encoded by the specification."""
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, master_weights="split8", state_dtype=saved_as, backend=backend)
    run_steps(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    other_params = clone_parameters(params)
    other = ampfused.FusedAmpAdamW(other_params, lr=0.5, master_weights="split8", state_dtype=loaded_as, backend=backend)
    run_steps(other, other_params, 1)
    before = snapshot(other, other_params)
    with pytest.raises(ValueError, match="to_torch_state_dict"):
        other.load_state_dict(sd)
    assert_bitwise_equal(before, snapshot(other, other_params))
    assert other.param_groups[0]["lr"] == 0.5
    fp32_form = to_torch_state_dict(sd, params)  # the way the message names
    other.load_state_dict(fp32_form)
    state, value = other.state[other_params[0]], fp32_form["state"][0]
    for key, kind in (("exp_avg", "signed"), ("exp_avg_sq", "sqrt")):
        codes, scales = (C.quantize4 if loaded_as == "int4" else C.quantize)(value[key], kind)
        same_bits(state[key + "_codes"], codes, key)
        same_bits(state[key + "_scales"], scales, key)


@pytest.mark.parametrize("master_weights,stochastic", [("split8", False), (False, True)])
def test_a_skipped_step_keeps_every_code_and_scale(backend, master_weights, stochastic):
    """(fp32, split16 and no-master int4 without SR: tests/compact/test_skipped_step.py over OPT_MODES.)"""
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, amsgrad=True, max_grad_norm=1.0, master_weights=master_weights,
                                 state_dtype="int4", stochastic_rounding=stochastic, backend=backend)
    run_steps(opt, params, 2, bad_steps=())
    assert "exp_avg_codes" in opt.state[params[0]]
    before = snapshot(opt, params)
    feed(opt, params, 99, bad=True)
    opt.step()
    assert opt.step_skipped.item() == 1.0
    assert_bitwise_equal(before, snapshot(opt, params))
