"""Checkpoints of compact state through the optimizer, on every backend: state_dict round-trips bit for
bit and continues the same run, torch.optim.AdamW's state dict loads into every mode, to_torch_state_dict
loads into torch, DCP round-trips, a mismatched mode is refused before any write, and the options
survive repr, pickle and deepcopy."""
import contextlib
import copy
import pickle

import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused._contract import packed_shape, scales_shape
from ampfused.checkpoint import to_torch_state_dict
from helpers import (DEVICE, OPT_MODES, assert_bitwise_equal, clone_parameters, full_state, opt_params, run_steps, same_bits,
                     snapshot, through_disk)


@pytest.mark.parametrize("master_weights,state_dtype", OPT_MODES)
def test_state_dict_round_trips_bitwise(backend, master_weights, state_dtype):
    kw = dict(lr=1e-2, amsgrad=True, master_weights=master_weights, state_dtype=state_dtype, backend=backend)
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(params, **kw)
    run_steps(opt, params, 2)  # every buffer of the mode is non-trivial after two steps
    saved = through_disk({"params": [p.detach() for p in params], "opt": opt.state_dict()})
    for i, entry in enumerate(saved["opt"]["state"].values()):  # the documented keys of the mode
        assert set(entry) == {"step"} | set(opt._state_room.keys(params[i], True)), entry.keys()
    restored_params = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    restored = ampfused.FusedAmpAdamW(restored_params, **kw)
    restored.load_state_dict(saved["opt"])
    for p, q in zip(params, restored_params):
        assert opt.state[p].keys() == restored.state[q].keys()
        for key in opt.state[p]:
            same_bits(restored.state[q][key], opt.state[p][key], key)
    if state_dtype in ("int8", "int4"):  # the codes' layout, and their torch form is the spec's decoding
        assert_blockwise_layout_and_torch_form(opt.state[params[0]], params[0].shape, state_dtype,
                                               to_torch_state_dict(saved["opt"], restored_params)["state"][0])
    torch.manual_seed(5)  # one step reads every restored buffer (and the step count)
    run_steps(opt, params, 1, first=10)
    torch.manual_seed(5)
    run_steps(restored, restored_params, 1, first=10)
    assert all(torch.equal(p, q) for p, q in zip(params, restored_params))


def assert_blockwise_layout_and_torch_form(state, shape, state_dtype, expanded):
    """int8 codes have the param's shape, int4 codes are packed two a byte along the last dimension;
    fp32 block scales; to_torch_state_dict gives the specification's decoding of them."""
    codes_shape, decode = (tuple(shape), C.dequantize) if state_dtype == "int8" else (packed_shape(shape), C.dequantize4)
    for key, kind in (("exp_avg", "signed"), ("exp_avg_sq", "sqrt"), ("max_exp_avg_sq", "sqrt")):
        codes, scales = state[key + "_codes"], state[key + "_scales"]
        codes_dtype = torch.int8 if (state_dtype, kind) == ("int8", "signed") else torch.uint8
        assert codes.dtype == codes_dtype and tuple(codes.shape) == codes_shape, (key, codes.dtype, codes.shape)
        assert scales.dtype == torch.float32 and tuple(scales.shape) == scales_shape(shape), (key, scales.shape)
        assert expanded[key].dtype == torch.float32 and expanded[key].shape == shape, key
        assert torch.equal(expanded[key], decode(codes, scales, kind)), key


@pytest.mark.parametrize("master_weights,state_dtype", OPT_MODES)
def test_torch_adamw_state_dict_loads_into_every_mode(backend, master_weights, state_dtype):
    params = opt_params()
    fp32_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    torch_opt = torch.optim.AdamW(fp32_params, lr=1e-2)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p in fp32_params:
            p.grad = torch.randn(p.shape, generator=g).to(DEVICE)
        torch_opt.step()
    torch_sd = torch_opt.state_dict()
    with torch.no_grad():
        for p, q in zip(params, fp32_params):
            p.copy_(q)  # the model's weights, rounded to bf16
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, master_weights=master_weights, state_dtype=state_dtype, backend=backend)
    opt.load_state_dict(torch_sd)
    run_steps(opt, params, 0)  # (no step: state_dict() takes pending masters from the params)
    for i, (p, decoded) in enumerate(zip(params, full_state(opt, params))):
        want = torch_sd["state"][i]
        assert decoded["step"].item() == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            kind = "signed" if key == "exp_avg" else "sqrt"
            if state_dtype is None or (state_dtype in ("int8", "int4") and "exp_avg_codes" not in opt.state[p]):
                # (fp32 moments: small tensors keep them under "int8" / "int4")
                assert torch.equal(decoded[key], want[key])
            elif state_dtype is torch.bfloat16:
                assert torch.equal(decoded[key], want[key].to(torch.bfloat16).float())
            elif state_dtype == "int4":  # the spec's encoding, within half the grid's widest gap of the block maximum
                assert torch.equal(decoded[key], C.dequantize4(*C.quantize4(want[key], kind), kind))
                assert_within_int4_grid(decoded[key], want[key], kind)
            else:
                torch.testing.assert_close(decoded[key], want[key], rtol=0.13, atol=1e-3 * want[key].abs().max().item())
        if master_weights is not False:  # a torch state has no master: the param is the master, exactly
            assert torch.equal(decoded["master_param"], p.detach().float())
    run_steps(opt, params, 2)
    assert all(torch.isfinite(p).all() for p in params)


def assert_within_int4_grid(decoded, value, kind):
    """``decoded`` is ``value`` to the resolution of its int4 grid: each element within half the widest gap
    between neighbouring levels (exp_avg: the gap next to 1, sqrt(exp_avg_sq): the one below it), in units
    of the largest block maximum (sqrt(v) for exp_avg_sq)."""
    levels = C.INT4_GRIDS[kind][0]
    half_gap = max(b - a for a, b in zip(levels, levels[1:])) / 2
    if kind == "sqrt":
        decoded, value = decoded.sqrt(), value.sqrt()
    bound = half_gap * value.abs().max().item() * (1 + 2 ** -20)  # (and the fp32 roundings of y and the decode)
    assert (decoded - value).abs().max().item() <= bound


@pytest.mark.parametrize("master_weights,state_dtype", OPT_MODES)
def test_to_torch_state_dict_loads_into_torch_adamw(backend, master_weights, state_dtype):
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, master_weights=master_weights, state_dtype=state_dtype, backend=backend)
    run_steps(opt, params, 3)
    sd = opt.state_dict()
    torch_sd = to_torch_state_dict(sd, params)
    for entry in torch_sd["state"].values():
        assert not any(C.is_compact_key(k) for k in entry)
        assert entry["exp_avg"].dtype == torch.float32
    masters = [torch.nn.Parameter(torch_sd["state"][i].get("master_param", p.detach().float()).clone())
               for i, p in enumerate(params)]
    torch_opt = torch.optim.AdamW(masters, lr=1e-2)
    torch_opt.load_state_dict(torch_sd)
    for i, p in enumerate(masters):
        assert torch.equal(torch_opt.state[p]["exp_avg"], torch_sd["state"][i]["exp_avg"])
        assert torch.equal(p.detach().to(torch.bfloat16), params[i].detach())  # the param is RNE of its master
    # and back: the fp32 form (with masters) into an ampfused fp32-mode optimizer
    fp32 = ampfused.FusedAmpAdamW(clone_parameters(params), lr=1e-2, backend=backend)
    fp32.load_state_dict(torch_sd)


@pytest.mark.parametrize("master_weights,state_dtype", [("split16", torch.bfloat16), ("split8", "int8")])
def test_dcp_round_trip_at_the_same_world_size(backend, master_weights, state_dtype, tmp_path):
    """torch.distributed.checkpoint save/load of compact state (one process: DCP without a process
    group) through get_state_dict/set_state_dict: every compact buffer back bitwise."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Linear(64, 8)).to(DEVICE, torch.bfloat16)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, master_weights=master_weights, state_dtype=state_dtype,
                                     backend=backend)
        return model, opt

    model, opt = build()
    for _ in range(2):
        model(torch.randn(4, 80, device=DEVICE, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
        model2, opt2 = build()
        model_sd, optim_sd = get_state_dict(model2, opt2)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
        set_state_dict(model2, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == opt2.state[q].keys()
        for key in opt.state[p]:
            same_bits(opt2.state[q][key], opt.state[p][key], key)


def test_mismatched_compact_mode_is_refused_before_any_write(backend):
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, master_weights="split8", state_dtype="int8", backend=backend)
    run_steps(opt, params, 2)
    sd = opt.state_dict()
    other_params = clone_parameters(params)
    other = ampfused.FusedAmpAdamW(other_params, lr=0.5, master_weights="split16", backend=backend)
    run_steps(other, other_params, 1)
    before = snapshot(other, other_params)
    with pytest.raises(ValueError, match="to_torch_state_dict"):
        other.load_state_dict(sd)
    assert_bitwise_equal(before, snapshot(other, other_params))
    assert other.param_groups[0]["lr"] == 0.5
    broken = copy.deepcopy(sd)
    broken["state"][0]["exp_avg_scales"] = broken["state"][0]["exp_avg_scales"][:-1]
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(broken)
    other.load_state_dict(to_torch_state_dict(sd, params))  # the way the message names


@pytest.mark.parametrize("master_weights,state_dtype", [("split16", torch.bfloat16), ("split8", "int8")])
def test_options_survive_repr_pickle_and_deepcopy(master_weights, state_dtype):
    params = opt_params()
    # split8 masters with int8 moments round nothing to bf16: stochastic_rounding warns that it does nothing
    with pytest.warns(ampfused.UnusedOptionWarning) if state_dtype == "int8" else contextlib.nullcontext():
        opt = ampfused.FusedAmpAdamW(params, master_weights=master_weights, state_dtype=state_dtype,
                                     stochastic_rounding=True, backend="reference")
    run_steps(opt, params, 2)
    text = repr(opt)
    assert f"{master_weights} master weights" in text and "stochastic_rounding: True" in text
    assert ("int8" if state_dtype == "int8" else "bfloat16") in text
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert (copied.master_weights, copied.state_dtype, copied.stochastic_rounding) == (master_weights, state_dtype, True)
        new_params = copied.param_groups[0]["params"]
        for p, q in zip(params, new_params):
            for key in opt.state[p]:
                same_bits(copied.state[q][key], opt.state[p][key], key)
        run_steps(copied, new_params, 1)



def test_a_format_1_checkpoint_is_refused_naming_the_conversion_which_reads_it(backend):
    """int8 scales of compact format 1 (one flat vector: blocks of the flattened tensor, before blocks
    in rows) are refused before any write, naming to_torch_state_dict, which decodes them."""
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, state_dtype="int8", backend=backend)
    run_steps(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    old = {}
    for key, kind in (("exp_avg", "signed"), ("exp_avg_sq", "sqrt")):  # the int8 tensor, saved as format 1 did
        value = C.dequantize(sd["state"][0][key + "_codes"], sd["state"][0][key + "_scales"], kind)
        codes, scales = C.quantize(value.reshape(-1), kind)
        sd["state"][0][key + "_codes"], sd["state"][0][key + "_scales"] = codes.view(value.shape), scales
        old[key] = C.dequantize(codes, scales, kind).view(value.shape)
    assert sd["state"][0]["exp_avg_scales"].dim() == 1 and params[0].dim() == 2
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"compact format 1.*to_torch_state_dict"):
        opt.load_state_dict(sd)
    assert_bitwise_equal(before, snapshot(opt, params))
    converted = to_torch_state_dict(sd, params)
    for key, value in old.items():
        assert torch.equal(converted["state"][0][key], value), key
    opt.load_state_dict(converted)  # the way the message names
    decoded = C.decode_state(opt.state[params[0]])
    torch.testing.assert_close(decoded["exp_avg"], old["exp_avg"], rtol=0.07, atol=1e-3 * old["exp_avg"].abs().max().item())
