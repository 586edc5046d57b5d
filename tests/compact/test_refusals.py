"""Bad compact state is refused by every backend's update op with an error naming the problem, before
anything is written (the CUDA host emulation runs the device code only: the op's checks are not in it);
bad compact options by the optimizer and the functional API."""
import re

import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused._contract import MASTER_ENCODINGS, MOMENT_DTYPE_NAMES
from helpers import DEVICE, assert_same_state, clone_compact, opt_params, same_bits, stats_vector, update_
from helpers import update_lists

SPLIT16_DTYPE = MASTER_ENCODINGS["split16"][0]  # the stored dtype of split16 low halves

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def refused(kernel, entries, errors, match, **changes):
    """``update_`` of ``entries`` with some lists replaced raises ``errors`` matching ``match``; nothing is written."""
    before = [clone_compact(e) for e in entries]
    lists = update_lists(entries)
    scales = changes.pop("moment_scales", ...)
    lists.update(changes)
    with pytest.raises(errors, match=match) as info:
        update_(kernel.backend, lists, [0] * len(entries), [kernel_hyper()], stats_vector(device=kernel.device),
                moment_scales=scales)
    kernel.sync()
    for i, (entry, old) in enumerate(zip(entries, before)):
        assert_same_state(entry, old, f"refused: tensor {i}")
        same_bits(entry[1], old[1], f"refused: tensor {i} grad")
    return str(info.value)


def kernel_hyper():
    from ampfused._batch import Hyper

    return Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)


def errors_of(kernel, compiled, triton):
    return triton if kernel.name == "triton" else compiled


@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
def test_blockwise_codes_without_scales_are_refused(checked_kernel, state_dtype):
    kernel = checked_kernel
    entry = kernel.entry(C.SMALL_TENSOR_NUMEL + 300, torch.bfloat16, "fp32", state_dtype)
    refused(kernel, [entry], errors_of(kernel, RuntimeError, ValueError), "moment_scales", moment_scales=None)


@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
@pytest.mark.parametrize("bad", ["short", "float64", "on a float moment"])
def test_bad_blockwise_scales_are_refused_before_anything_is_written(checked_kernel, bad, state_dtype):
    """Every tensor is checked before the first write: a bad entry of the second tensor leaves the first untouched."""
    kernel = checked_kernel
    n = C.SMALL_TENSOR_NUMEL + 300
    good = kernel.entry(n, torch.bfloat16, "split8", state_dtype, seed=70)
    other = kernel.entry(n, torch.bfloat16, "split8", state_dtype if bad != "on a float moment" else torch.float32, seed=71)
    scales = update_lists([good, other])["moment_scales"]
    if bad == "short":
        scales[1] = (scales[1][0][:-1], scales[1][1], None)
    elif bad == "float64":
        scales[1] = (scales[1][0].double(), scales[1][1], None)
    else:
        scales[1] = scales[0]
    refused(kernel, [good, other], errors_of(kernel, RuntimeError, (ValueError, TypeError)), "scales", moment_scales=scales)


def bad_entry(kernel, param_dtype=torch.bfloat16, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
              packed=()):
    """A 300-element param with moments of these dtypes, those named in ``packed`` of 150 bytes (int4 codes)."""
    param = torch.randn(300).to(param_dtype).to(kernel.device)
    state = {"step": torch.tensor(0.0, device=kernel.device),
             "exp_avg": torch.zeros(150 if "exp_avg" in packed else 300, dtype=exp_avg_dtype, device=kernel.device),
             "exp_avg_sq": torch.zeros(150 if "exp_avg_sq" in packed else 300, dtype=exp_avg_sq_dtype,
                                       device=kernel.device)}
    return param, torch.ones(300, dtype=param_dtype, device=kernel.device), state


# (entry, changed lists, the compiled op's message, the Triton wrapper's)
BAD_DTYPES = {
    "split16 master, fp16 param": (dict(param_dtype=torch.float16), dict(masters=[SPLIT16_DTYPE]),
                                 *["bfloat16 (split16 low halves), which needs a bfloat16 param"] * 2),
    "int8 master, fp32 param": (dict(param_dtype=torch.float32), dict(masters=[torch.int8]),
                                *["int8 (split8 residuals), which needs a bfloat16 or float16 param"] * 2),
    "split16 master, fp32 param": (dict(param_dtype=torch.float32), dict(masters=[SPLIT16_DTYPE]), "split16", "split16"),
    "int32 master": ({}, dict(masters=[torch.int32]), "must be float32 (fp32 master), bfloat16 (split16) or int8 (split8)",
                     "master"),
    "int8 codes, no scales": (dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8), {},
                              "holds int8 codes but moment_scales is None", "moment_scales"),
    "uint8 exp_avg codes, int8's size": (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), {},
                                         "holds int4 codes and must be a contiguous uint8 tensor of 150 bytes",
                                         "packed_shape"),
    "int4 codes, no scales": (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
                                   packed=("exp_avg", "exp_avg_sq")), {},
                              "holds int4 codes but moment_scales is None", "moment_scales"),
    "int4 exp_avg, int8 exp_avg_sq": (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
                                           packed=("exp_avg",)), {},
                                      "exp_avg_sqs[0] holds int4 codes and must be a contiguous uint8 tensor of 150 bytes",
                                      "packed_shape"),
    "int4 exp_avg, fp32 exp_avg_sq": (dict(exp_avg_dtype=torch.uint8, packed=("exp_avg",)), {},
                                      "int4 moments keep all three as uint8 bytes of two codes", "exp_avg_sqs[0]"),
    "mixed moment dtypes": (dict(exp_avg_dtype=torch.bfloat16), {}, "a tensor's moments share one dtype", "dtype"),
    "fp16 moments": (dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16), {},
                     f"must be {MOMENT_DTYPE_NAMES}, got Half", "exp_avgs[0] has dtype torch.float16"),
}


@pytest.mark.parametrize("case", list(BAD_DTYPES))
def test_bad_compact_dtypes_are_refused_before_anything_is_written(checked_kernel, case):
    kernel = checked_kernel
    make, changes, compiled_message, triton_message = BAD_DTYPES[case]
    entry = bad_entry(kernel, **make)
    changes = {k: [torch.zeros(300, dtype=dtype, device=kernel.device) for dtype in v] for k, v in changes.items()}
    refused(kernel, [entry], errors_of(kernel, RuntimeError, (ValueError, TypeError)),
            re.escape(triton_message if kernel.name == "triton" else compiled_message), moment_scales=None, **changes)


# ------------------------------------------------------------------ options


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(master_weights="split4"), ValueError, "master_weights"),
    (dict(master_weights="fp16"), ValueError, "master_weights"),
    (dict(state_dtype=torch.float16), ValueError, "state_dtype"),
    (dict(state_dtype="int2"), ValueError, "state_dtype"),
    (dict(stochastic_rounding=1), TypeError, "stochastic_rounding"),
])
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ampfused.FusedAmpAdamW(opt_params(), **kwargs)


def test_split16_refuses_fp16_params():
    params = opt_params() + [torch.nn.Parameter(torch.randn(10, device=DEVICE).half())]
    with pytest.raises(ValueError, match="split8"):
        ampfused.FusedAmpAdamW(params, master_weights="split16")
    opt = ampfused.FusedAmpAdamW(opt_params(), master_weights="split16")
    with pytest.raises(ValueError, match=re.escape("bfloat16 (split16 low halves), which needs a bfloat16 param")):
        opt.add_param_group({"params": [params[-1]]})
    ampfused.FusedAmpAdamW(params, master_weights="split8")  # fp16 params take split8


def test_functional_api_checks_compact_lists():
    p = torch.randn(4096, device=DEVICE).half()
    z = torch.zeros(4096, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("is bfloat16 (split16 low halves), which needs a bfloat16 param")):
        ampfused.functional.fused_amp_adamw([p], [p.clone()], [z], [z.clone()], [None], [torch.zeros(())],
                                            [torch.zeros(4096, dtype=SPLIT16_DTYPE)], lr=1e-3, beta1=0.9, beta2=0.999,
                                            eps=1e-8, weight_decay=0.0)
    codes = torch.zeros(4096, dtype=torch.int8)
    with pytest.raises(ValueError, match="moment_scales"):
        ampfused.functional.fused_amp_adamw([p], [p.clone()], [codes], [codes.view(torch.uint8)], [None], [torch.zeros(())],
                                            [None], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)

