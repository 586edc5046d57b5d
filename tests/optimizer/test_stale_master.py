"""No stale master, ever (issue 34 item 7).

A bf16 model's ampfused state goes to torch.optim.AdamW (``to_torch_state_dict`` with the params:
fp32 masters in it), which casts the ``master_param`` it does not know to bf16 and carries it along,
never updated, for 20 steps. Loading that stock state dict back must not take the old master: the
master is the param (bitwise), one warning says why, and the next step is the one a fresh fp32
master gives (the same mode loaded without any master; for fp32 moments also torch.optim.AdamW on
fp32 masters). State loaded the ordinary way, in either order, does not warn. Every backend, the
default mode and every compact one.
"""
import warnings

import pytest
import torch

import ampfused
from helpers import bits, load_in_order, mlp, through_disk, tol

# (master_weights, state_dtype): the default and every compact mode of a bf16 model
MODES = [(None, None), ("split16", None), ("split8", None), (None, torch.bfloat16), (None, "int8"), (None, "int4")]
MODE_IDS = ["default", "split16", "split8", "bf16-moments", "int8-moments", "int4-moments"]
EXACT_MODES = MODES[:2]  # fp32 moments and a master that is the fp32 one (split16: bitwise, DESIGN §9)
ORDERS = ("model first", "optimizer first")
STOCK_STEPS = 20
HYPER = dict(lr=1e-2, weight_decay=0.1)


def small_bf16_model(device, seed=0):
    # the 80x64 weight (5,120 elements, rows of 64) is above the size where int8 / int4 moments start; the rest stays below it
    return mlp(64, 80, 3, dtype=torch.bfloat16, device=device, seed=seed)


def batch_at(step, device):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 64, generator=g).to(device, torch.bfloat16), torch.randn(8, 3, generator=g).to(device)


def train_steps(model, opt, steps, first=0):
    for step in range(first, first + steps):
        x, y = batch_at(step, next(model.parameters()).device)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def ampfused_opt(model, backend, mode):
    master_weights, state_dtype = mode
    return ampfused.FusedAmpAdamW(model.parameters(), **HYPER, master_weights=master_weights, state_dtype=state_dtype,
                                  backend=backend)


def masters_of(opt):
    """The fp32 master of every param (decoded from a split master), through the public converter."""
    params = [p for g in opt.param_groups for p in g["params"]]
    sd = ampfused.checkpoint.to_torch_state_dict(opt.state_dict(), params)
    return [sd["state"][i].get("master_param") for i in range(len(params))]


def stock_state_after_training_on(device, backend, mode):
    """(the bf16 model's weights, torch.optim.AdamW's state dict) after ampfused steps, then 20 stock ones."""
    trained = small_bf16_model(device)
    opt = ampfused_opt(trained, backend, mode)
    train_steps(trained, opt, 3)
    torch_form = through_disk(ampfused.checkpoint.to_torch_state_dict(opt.state_dict(), list(trained.parameters())))
    model = small_bf16_model(device)  # a model of its own: ampfused's hooks keep the first one's grads in fp32
    model.load_state_dict(through_disk(trained.state_dict()))
    params = list(model.parameters())
    stock = torch.optim.AdamW(params, **HYPER)
    stock.load_state_dict(torch_form)
    carried = [stock.state[p]["master_param"] for p in params]
    assert all(m.dtype == torch.bfloat16 for m in carried), "the test needs torch's cast, stale masters"
    train_steps(model, stock, STOCK_STEPS, first=3)
    stale = [stock.state[p]["master_param"].float() for p in params]
    assert any(not torch.equal(m, p.detach().float()) for m, p in zip(stale, params)), "the carried masters must be stale"
    return through_disk(model.state_dict()), through_disk(stock.state_dict())


def resume(device, backend, mode, model_sd, opt_sd, order):
    model = small_bf16_model(device, seed=1)  # other weights, as a resumed script builds them
    opt = ampfused_opt(model, backend, mode)
    load_in_order(model, opt, model_sd, opt_sd, order)
    return model, opt


def without_masters(sd):
    return {"state": {i: {k: v for k, v in s.items() if k != "master_param"} for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}



def compact_state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_master_stock_adamw_carried_is_not_taken(backend, device, mode):
    model_sd, stock_sd = stock_state_after_training_on(device, backend, mode)  # one stock run, resumed in each order
    for order in ORDERS:
        with pytest.warns(UserWarning, match="is not float32") as caught:
            model, opt = resume(device, backend, mode, model_sd, stock_sd, order)
        assert len([w for w in caught if "master_param" in str(w.message)]) == 1, f"{order}: one warning per load"
        params = list(model.parameters())
        for i, (m, p) in enumerate(zip(masters_of(opt), params)):
            assert m is not None and torch.equal(m, p.detach().float()), f"{order}: param {i}: the master must be the param"

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the ordinary torch form (no master) loads silently
            fresh_model, fresh = resume(device, backend, mode, model_sd, without_masters(stock_sd), order)
        for opt_, model_ in ((opt, model), (fresh, fresh_model)):
            train_steps(model_, opt_, 1, first=3 + STOCK_STEPS)
        for i, (a, b) in enumerate(zip(model.parameters(), fresh_model.parameters())):
            assert torch.equal(a, b), f"{order}: param {i}: the step after the load is not the fresh-master step"
        for i, (a, b) in enumerate(zip(compact_state(opt), compact_state(fresh))):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(bits(a[key]), bits(b[key])), f"{order}: param {i}: {key} differs from the fresh-master step's"

        if mode in EXACT_MODES:  # also torch.optim.AdamW on fp32 masters taken from the params
            fp32 = [torch.nn.Parameter(v.float()) for v in model_sd.values()]  # (Sequential: state-dict order is params order)
            recipe = torch.optim.AdamW(fp32, **HYPER)
            recipe.load_state_dict(without_masters(stock_sd))  # fp32 params: torch keeps the moments in fp32
            x, y = batch_at(3 + STOCK_STEPS, device)
            twin = small_bf16_model(device)
            twin.load_state_dict(model_sd)
            torch.nn.functional.mse_loss(twin(x).float(), y).backward()
            for q, p in zip(fp32, twin.parameters()):
                q.grad = p.grad.float()
            recipe.step()
            for i, (m, q) in enumerate(zip(masters_of(opt), fp32)):
                torch.testing.assert_close(m, q.detach(), **tol(backend), msg=f"{order}: param {i}: master after the step")


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_state_loaded_the_ordinary_way_does_not_warn(backend, device, mode):
    """ampfused's own state dict and its torch form (fp32 masters), each loaded before or after the model."""
    model = small_bf16_model(device)
    opt = ampfused_opt(model, backend, mode)
    train_steps(model, opt, 2)
    model_sd = through_disk(model.state_dict())
    own = through_disk(opt.state_dict())
    torch_form = through_disk(ampfused.checkpoint.to_torch_state_dict(opt.state_dict(), list(model.parameters())))
    expected = masters_of(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for order in ORDERS:
            for what, sd in (("own", own), ("torch form", torch_form)):
                resumed, loaded = resume(device, backend, mode, model_sd, sd, order)
                for i, (a, b) in enumerate(zip(masters_of(loaded), expected)):
                    assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{order}, {what}: master {i} changed"
                train_steps(resumed, loaded, 1, first=2)


@pytest.mark.parametrize("mode", [MODES[0], MODES[1]], ids=MODE_IDS[:2])
def test_a_stale_master_cast_back_to_fp32_is_not_taken_either(backend, device, mode):
    """What plain DCP hands the optimizer: the carried bf16 master copied into an fp32 tensor. It cannot be
    told from a master (no warning), but a master the param's dtype holds exactly is its param anyway."""
    model_sd, stock_sd = stock_state_after_training_on(device, backend, mode)
    for entry in stock_sd["state"].values():
        entry["master_param"] = entry["master_param"].float()
    for order in ORDERS:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model, opt = resume(device, backend, mode, model_sd, stock_sd, order)
        for i, (m, p) in enumerate(zip(masters_of(opt), model.parameters())):
            assert torch.equal(m, p.detach().float()), f"{order}: param {i}: the master must be the param"
