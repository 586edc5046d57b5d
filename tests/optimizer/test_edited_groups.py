"""Param-group values edited after construction (by a user, a scheduler or a trainer) are checked when
the step rebuilds the group's row: the constructor's message, naming the group, raised before the step
writes anything; schedulers and tensor lrs keep working, and a warm step whose groups did not change
checks nothing again (issue 36 item 2)."""
import pytest
import torch

import ampfused
from ampfused import _plan
from helpers import assert_bitwise_equal, make_params, random_grads, snapshot

SHAPES = [(6, 4), (5,)]

# (key, value, error, the constructor's message); one per kind of bad value
BAD_VALUES = [
    ("betas", (0.9, 1.5), ValueError, r"Invalid beta parameter at index 1: 1.5 \(betas\[1\]\)"),
    ("betas", (float("nan"), 0.999), ValueError, r"Invalid beta parameter at index 0: nan \(betas\[0\]\)"),
    ("betas", (0.9,), ValueError, r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    ("betas", (0.9, "0.999"), TypeError, r"betas\[1\] must be a float or a 1-element Tensor, got str '0.999'"),
    ("lr", "3e-4", TypeError, "lr must be a float or a 1-element Tensor, got str '3e-4'"),
    ("lr", None, TypeError, "lr must be a float or a 1-element Tensor, got NoneType None"),
    ("lr", float("nan"), ValueError, r"Invalid learning rate: nan \(lr\)"),
    ("lr", -1e-3, ValueError, r"Invalid learning rate: -0.001 \(lr\)"),
    ("lr", torch.tensor([1e-3, 1e-3]), ValueError, r"Tensor lr must be 1-element, got shape \(2,\)"),
    ("eps", -1e-8, ValueError, r"Invalid epsilon value: -1e-08 \(eps\)"),
    ("eps", None, TypeError, "eps must be a float, got NoneType None"),
    ("weight_decay", float("nan"), ValueError, "Invalid weight_decay value: nan"),
    ("weight_decay", "0.01", TypeError, "weight_decay must be a float, got str '0.01'"),
    ("amsgrad", "False", TypeError, r"amsgrad must be a bool \(True or False\), got str 'False'"),
    ("maximize", None, TypeError, r"maximize must be a bool \(True or False\), got NoneType None"),
]
IDS = [f"{key}={value!r}" for key, value, _, _ in BAD_VALUES]


def _two_groups(backend, dtype=torch.float32):
    params = make_params(SHAPES, dtype=dtype)
    opt = ampfused.FusedAmpAdamW([{"params": params[:1]}, {"params": params[1:], "lr": 1e-2}], backend=backend)
    return params, opt


def _feed(params, seed):
    for p, g in zip(params, random_grads(params, seed)):
        p.grad = g.to(p.dtype)


def _everything(opt, params):
    """Bitwise copies of params, grads and state, and the group values (the edit aside)."""
    snap = snapshot(opt, params)
    snap.update({("grad", i): p.grad.clone() for i, p in enumerate(params)})
    return snap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key,value,error,message", BAD_VALUES, ids=IDS)
def test_a_bad_value_set_after_a_warm_step_is_refused_by_name_and_writes_nothing(backend, dtype, key, value, error, message):
    params, opt = _two_groups(backend, dtype)
    for step in range(2):  # warm: plan, rows and state built
        _feed(params, step)
        opt.step()
    _feed(params, 2)
    good = opt.param_groups[1][key]
    opt.param_groups[1][key] = value
    before = _everything(opt, params)
    with pytest.raises(error, match=message + r" in param_groups\[1\]"):
        opt.step()
    assert_bitwise_equal(before, _everything(opt, params))
    opt.param_groups[1][key] = good  # put right, the optimizer trains on
    opt.step()
    assert all(opt.state[p]["step"].item() == 3 for p in params)


@pytest.mark.parametrize("key,value,error,message", BAD_VALUES, ids=IDS)
def test_a_bad_value_set_before_the_first_step_makes_no_state(backend, key, value, error, message):
    """The first step checks the rows before it lays out the lazy state: a refused step leaves none."""
    params, opt = _two_groups(backend)
    _feed(params, 0)
    opt.param_groups[1][key] = value
    before = [p.detach().clone() for p in params]
    with pytest.raises(error, match=message + r" in param_groups\[1\]"):
        opt.step()
    assert not any(opt.state.values()), "a refused first step made state"
    assert all(torch.equal(b, p) for b, p in zip(before, params))


@pytest.mark.parametrize("key,value,message", [
    ("amsgrad", "False", r"amsgrad must be a bool \(True or False\), got str 'False'"),
    ("maximize", 2, r"maximize must be a bool \(True or False\), got int 2"),
])
def test_the_constructor_refuses_flags_that_are_not_yes_or_no(key, value, message):
    """torch reads amsgrad/maximize as truth values, so a config's "False" turns AMSGrad on; refused here."""
    with pytest.raises(TypeError, match=message):
        ampfused.FusedAmpAdamW(make_params(SHAPES), **{key: value})
    with pytest.raises(TypeError, match=message):
        ampfused.FusedAmpAdamW([{"params": make_params(SHAPES), key: value}])


def test_flags_given_as_0_or_1_are_accepted():
    ampfused.FusedAmpAdamW(make_params(SHAPES), amsgrad=0, maximize=1)


def test_a_list_of_betas_edited_in_place_is_checked(backend):
    """The row is rebuilt when an element of a betas list changes, not only when the list is replaced."""
    params = make_params(SHAPES)
    opt = ampfused.FusedAmpAdamW([{"params": params, "betas": [0.9, 0.999]}], backend=backend)
    _feed(params, 0)
    opt.step()
    opt.param_groups[0]["betas"][1] = 1.0
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1.0 \(betas\[1\]\) in param_groups\[0\]"):
        opt.step()


def test_a_warm_step_with_unchanged_groups_checks_nothing_again(backend, monkeypatch):
    """The check runs where a row is rebuilt: once per plan, then only for a group whose values changed."""
    params, opt = _two_groups(backend)
    checked = []
    real = _plan.check_hyperparameters
    monkeypatch.setattr(_plan, "check_hyperparameters", lambda lr, *a, **k: (checked.append(lr), real(lr, *a, **k)))
    for step in range(3):
        _feed(params, step)
        opt.step()
    assert checked == [1e-3, 1e-2], f"rows checked again on warm steps: {checked}"
    opt.param_groups[0]["lr"] = 5e-4  # a scheduler's edit: that group's row alone is checked and rebuilt
    _feed(params, 3)
    opt.step()
    assert checked == [1e-3, 1e-2, 5e-4]


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float lr", "tensor lr"])
def test_a_scheduler_still_drives_the_step_as_in_torch(backend, tensor_lr):
    """A scheduler rewrites group["lr"] every step (a new float, or in place for a tensor lr): each step
    uses the new value, as torch.optim.AdamW does."""
    runs = []
    for make in (torch.optim.AdamW, lambda ps, **kw: ampfused.FusedAmpAdamW(ps, backend=backend, **kw)):
        params = make_params(SHAPES)
        opt = make(params, lr=torch.tensor(1e-2) if tensor_lr else 1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(4):
            _feed(params, step)
            opt.step()
            scheduler.step()
        runs.append(params)
    for expected, actual in zip(*runs):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_tensor_betas_changed_in_place_are_read_and_checked(backend):
    """A tensor beta edited in place (torch reads it as a float at each step) is seen, and checked."""
    params = make_params(SHAPES)
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    opt = ampfused.FusedAmpAdamW(params, betas=betas, backend=backend)
    _feed(params, 0)
    opt.step()
    betas[1].fill_(1.5)
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1.5 \(betas\[1\]\) in param_groups\[0\]"):
        opt.step()
