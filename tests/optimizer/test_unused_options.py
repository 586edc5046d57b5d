"""An option that can have no effect on the params it was given warns once at construction, naming
why (issue 36 item 3); options that do act stay silent, and the repr is unchanged."""
import copy
import pickle
import re
import warnings

import pytest
import torch

import ampfused
from ampfused import UnusedOptionWarning
from ampfused._contract import compact_modes, master_encoding
from ampfused._state import master_of, moment_key
from helpers import DEVICE

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _params_of_dtypes(*dtypes):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 4, device=DEVICE).to(dtype)) for dtype in dtypes]


NO_EFFECT = [
    ((F32,), dict(master_weights="split16"), r'master_weights="split16" has no effect: no param is fp16/bf16'),
    ((F32, torch.float64), dict(master_weights="split8"), r'master_weights="split8" has no effect: no param is fp16/bf16'),
    ((F32,), dict(stochastic_rounding=True), "stochastic_rounding=True has no effect: .* the moments are fp32 and "
                                             "no param is bf16"),
    ((BF16, F32), dict(stochastic_rounding=True), "stochastic_rounding=True has no effect: .* the bf16 params have "
                                                  "fp32 masters"),
    ((BF16,), dict(stochastic_rounding=True, master_weights="split16"), "the bf16 params have split16 masters"),
    ((F16,), dict(stochastic_rounding=True, master_weights=False), "no param is bf16"),  # fp16 rounds to nearest
    ((F32,), dict(fp32_grad_accumulation=True), "fp32_grad_accumulation=True has no effect: no param is fp16/bf16"),
]


@pytest.mark.parametrize("dtypes,options,match", NO_EFFECT,
                         ids=[f"{'+'.join(str(d)[6:] for d in ds)}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for ds, o, _ in NO_EFFECT])
def test_an_option_with_no_effect_warns_once_saying_why(dtypes, options, match):
    with pytest.warns(UnusedOptionWarning) as record:
        ampfused.FusedAmpAdamW(_params_of_dtypes(*dtypes), **options)
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert re.search(match, message), message
    assert "add_param_group" in message  # params added later may make it meaningful
    assert record[0].filename == __file__  # points at the caller's line, not into ampfused


def test_every_option_without_effect_gets_its_own_warning():
    with pytest.warns(UnusedOptionWarning) as record:
        ampfused.FusedAmpAdamW(_params_of_dtypes(F32), master_weights="split16", stochastic_rounding=True,
                               fp32_grad_accumulation=True)
    assert sorted(str(w.message).split(" has no effect")[0] for w in record) == [
        "ampfused: fp32_grad_accumulation=True", 'ampfused: master_weights="split16"', "ampfused: stochastic_rounding=True"]


@pytest.mark.parametrize("dtypes,options", [
    ((F32,), {}), ((BF16,), dict(master_weights="split16")), ((F16,), dict(master_weights="split8")),
    ((F32, BF16), dict(master_weights="split8")),
    ((BF16,), dict(stochastic_rounding=True, master_weights=False)),
    ((F32,), dict(stochastic_rounding=True, state_dtype=BF16)),
    ((F16,), dict(fp32_grad_accumulation=True, master_weights=False)),
    ((F32,), dict(master_weights=False, fp32_grad_accumulation=False)),  # the defaults' opposites: nothing asked
])
def test_options_that_act_do_not_warn(dtypes, options):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedOptionWarning)
        ampfused.FusedAmpAdamW(_params_of_dtypes(*dtypes), **options)


@pytest.mark.parametrize("dtype,master_weights", [(d, m) for d in (F32, F16, BF16) for m in ("fp32", "split16", "split8", False)
                                                  if not (m == "split16" and d == F16)])  # split16 refuses fp16 params
@pytest.mark.parametrize("state_dtype", [None, BF16, "int8", "int4"])
def test_the_stochastic_rounding_warning_agrees_with_what_the_step_rounds(backend, dtype, master_weights, state_dtype):
    """Warned exactly when no param's state needs the "sr" mode of the step (``_contract.compact_modes``)."""
    params = [torch.nn.Parameter(torch.randn(n, device=DEVICE).to(dtype)) for n in (64, 5000)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = ampfused.FusedAmpAdamW(params, master_weights=master_weights, state_dtype=state_dtype,
                                     stochastic_rounding=True, backend=backend)
    warned = any(issubclass(w.category, UnusedOptionWarning) and "stochastic_rounding" in str(w.message) for w in record)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    rounded = any("sr" in compact_modes(p, opt.state[p][moment_key(opt.state[p], "exp_avg")], master_of(opt.state[p]), True)
                  for p in params)
    assert warned == (not rounded), (warned, rounded, [master_encoding(master_of(opt.state[p])) for p in params])


def test_the_repr_is_unchanged_and_copies_do_not_warn_again():
    with pytest.warns(UnusedOptionWarning):
        opt = ampfused.FusedAmpAdamW(_params_of_dtypes(F32), master_weights="split16")
    assert "split16 master weights: 0 of 0 fp16/bf16 params" in repr(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedOptionWarning)
        copy.deepcopy(opt)
        pickle.loads(pickle.dumps(opt))


def test_a_param_group_added_later_uses_the_option_it_warned_about(backend):
    """The warning says add_param_group may make the option meaningful: it does, and nothing refuses it."""
    with pytest.warns(UnusedOptionWarning, match="split16"):
        opt = ampfused.FusedAmpAdamW(_params_of_dtypes(F32), master_weights="split16", backend=backend)
    (late,) = _params_of_dtypes(BF16)
    opt.add_param_group({"params": [late]})
    late.grad = torch.full_like(late, 1e-3, dtype=torch.float32)
    opt.step()
    assert "master_low16" in opt.state[late] and "master_param" not in opt.state[late]
