"""The Triton update pass's compact variants against the specification ``ampfused._compact.compact_adamw_step_``.

The wrapper ``ampfused.kernels.adamw_update_`` is called directly with hand-built lists (the tensors
of ``_compact``'s state dicts): bitwise equality for the round-to-nearest modes (split16 also
against the Triton fp32-master path), statistics for stochastic rounding; a skipped step leaves
every buffer unchanged; compact and plain tensors share one launch. Small sizes: on a CPU machine
the kernels run in Triton's interpreter.
"""
import pytest
import torch

from ampfused import _backends
from ampfused import _compact as C
from helpers import assert_same_state, same_bits
from helpers import clone_compact as clone, decoded_twin as fp32_twin
from helpers import DEVICE
from helpers import COMPACT_HYPER, batch_of, compact_entry, compact_hyper, compact_update, update_lists

kernels, _reason = _backends.probe("triton")
if kernels is None or kernels.supports(DEVICE):
    pytest.skip(f"triton backend unavailable on {DEVICE}: {_reason or kernels.supports(DEVICE)}", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# A tail block, a second chunk in the interpreter (CHUNK 1024), and more than one int8 scale block.
N = 1300
LARGE = C.SMALL_TENSOR_NUMEL + 300  # int8 moments need SMALL_TENSOR_NUMEL elements
HYPER = COMPACT_HYPER
hyper, lists_of = compact_hyper, update_lists


def make(n, param_dtype, master_weights, state_dtype, amsgrad=False, seed=0):
    """(param, grad, compact state) with non-trivial moments and master, on DEVICE."""
    return compact_entry(n, param_dtype, master_weights, state_dtype, DEVICE, amsgrad, seed)


def triton_step(entries, amsgrad=False, maximize=False, factor=1.0, skip=0.0, grad_scale=None, rounding_seed=None):
    compact_update(kernels, entries, amsgrad, maximize, factor, skip, grad_scale, rounding_seed)


def spec_step(param, grad, state, amsgrad=False, maximize=False, factor=1.0, skip=0.0, stochastic=False):
    C.compact_adamw_step_(param, grad, state, **HYPER, amsgrad=amsgrad, maximize=maximize,
                          factor=torch.tensor(factor, device=DEVICE), skip=torch.tensor(skip, device=DEVICE),
                          stochastic_rounding=stochastic, generator=torch.Generator(DEVICE).manual_seed(1))


def quantize_sqrt(v):
    """``_compact.quantize(v, "sqrt")`` with a correctly rounded fp32 sqrt, as the kernels take it
    (``sqrt_rn``, the GPU's and IEEE's). torch's CPU ``Tensor.sqrt`` on fp32 is not correctly
    rounded in every build (1 ulp off for ~16% of inputs here), which moves a block scale by an ulp."""
    blocks, _ = C._blocks(v)
    roots = blocks.double().sqrt().float()
    scales = roots.amax(dim=1)
    y = roots / scales[:, None]
    k = torch.where(torch.isfinite(y), C._encode_unit(y, 4), 0).clamp(max=240)
    return k.reshape(-1)[: v.numel()].to(torch.uint8).view(v.shape), scales


def encoded(twin, master_weights, state_dtype):
    """The fp32 path's results encoded by the specification (``_compact.encode_state``)."""
    param, grad, state = twin
    param = param.clone()
    out = C.encode_state(param, state, master_weights, state_dtype)
    for key in ("exp_avg_sq", "max_exp_avg_sq"):
        if key + "_codes" in out:
            out[key + "_codes"], out[key + "_scales"] = quantize_sqrt(state[key])
    return param, grad, out


def assert_close_to_spec(actual, expected, what):
    """The compact step against ``compact_adamw_step_``: the fp32 math may differ by an fp32 ulp
    (``sqrt(v) / bias_correction2``: the Triton path divides in fp32, torch's CPU kernel not quite;
    tests/contract/test_passes.py compares that path with a tolerance too), so encodings may differ
    by one step of their grid."""
    (a_param, _, a_state), (e_param, _, e_state) = actual, expected
    torch.testing.assert_close(a_param.float(), e_param.float(), rtol=2 ** -7, atol=1e-5, msg=f"{what} param")
    for key in e_state:
        got, want = a_state[key], e_state[key]
        if key.endswith("_codes"):
            assert (got.int() - want.int()).abs().max().item() <= 1, f"{what} {key}: a code more than one grid step off"
        elif key in ("master_low16", "master_residual8"):
            torch.testing.assert_close(C.decode_state(a_state, a_param)["master_param"],
                                       C.decode_state(e_state, e_param)["master_param"], rtol=1e-6, atol=1e-7)
        elif got.dtype == torch.bfloat16:
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0, msg=f"{what} {key}")
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{what} {key}")


def check_step(entries, modes, **kwargs):
    """Step ``entries`` (compact) with Triton; each must equal, bit for bit, the Triton fp32 path on
    its decoded state with the results encoded by the specification, and be close to the spec's step."""
    twins = [fp32_twin(e) for e in entries]
    spec = [clone(e) for e in entries]
    triton_step(entries, **kwargs)
    triton_step(twins, **kwargs)
    for i, (entry, twin, ref, (master_weights, state_dtype)) in enumerate(zip(entries, twins, spec, modes)):
        what = f"tensor {i} ({master_weights}/{state_dtype})"
        assert_same_state(entry, encoded(twin, master_weights, state_dtype), what)
        spec_step(*ref, amsgrad=kwargs.get("amsgrad", False), maximize=kwargs.get("maximize", False),
                  factor=kwargs.get("factor", 1.0))
        assert_close_to_spec(entry, ref, what)
    return twins


MODES = [  # (param dtype, master_weights, state_dtype, n)
    pytest.param(torch.bfloat16, "split16", torch.float32, N, id="split16"),
    pytest.param(torch.bfloat16, "fp32", torch.bfloat16, N, id="bf16-moments"),
    pytest.param(torch.bfloat16, "split16", torch.bfloat16, N, id="split16-bf16-moments"),
    pytest.param(torch.float32, "fp32", torch.bfloat16, N, id="fp32-param-bf16-moments"),
    pytest.param(torch.bfloat16, "none", torch.bfloat16, N, id="no-master-bf16-moments"),
    pytest.param(torch.bfloat16, "split8", torch.float32, N, id="split8-bf16"),
    pytest.param(torch.float16, "split8", torch.float32, N, id="split8-fp16"),
    pytest.param(torch.float16, "split8", torch.bfloat16, N, id="split8-fp16-bf16-moments"),
    pytest.param(torch.bfloat16, "split16", "int8", LARGE, id="split16-int8"),
    pytest.param(torch.float32, "fp32", "int8", LARGE, id="fp32-int8"),
]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES)
def test_round_to_nearest_modes(param_dtype, master_weights, state_dtype, n, amsgrad):
    entry = make(n, param_dtype, master_weights, state_dtype, amsgrad)
    check_step([entry], [(master_weights, state_dtype)], amsgrad=amsgrad, maximize=amsgrad, factor=0.5)


def test_int8_blocks_of_two_scale_blocks(monkeypatch):
    """The GPU's block of 512 elements: a [2, 256] tile, two scales per block (the interpreter's
    default block holds one)."""
    from ampfused.kernels import _runtime

    monkeypatch.setattr(_runtime, "UPDATE_BLOCK", 512)
    entries = [make(LARGE, torch.bfloat16, "split16", "int8", amsgrad=True), make(LARGE + 700, torch.float32, "fp32", "int8",
                                                                                 amsgrad=True, seed=1)]
    check_step(entries, [("split16", "int8"), ("fp32", "int8")], amsgrad=True)


def test_split16_equals_the_fp32_master_path_bitwise():
    """The split master decodes to the fp32 path's master (no tie arises in random data: checked)."""
    split = make(3 * N, torch.bfloat16, "split16", torch.float32, seed=3)
    fp32 = make(3 * N, torch.bfloat16, "fp32", torch.float32, seed=3)
    for _ in range(3):
        triton_step([split], maximize=True)
        triton_step([fp32], maximize=True)
    same_bits(split[0], fp32[0], "param")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        same_bits(split[2][key], fp32[2][key], key)
    assert not torch.any(fp32[2]["master_param"].view(torch.int32) & 0xFFFF == 0x8000), "a tie: use another seed"
    same_bits(C.join16(split[0], split[2]["master_low16"]), fp32[2]["master_param"], "master")


def test_split16_tie_rule():
    """Masters whose new value has the low half 0x8000 (made by weight decay alone: zero grads and
    exp_avg) are stored one fp32 ulp toward the param, as the specification says; the param is
    the fp32 path's."""
    decay = torch.tensor(1 - HYPER["lr"] * HYPER["weight_decay"], dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    targets = ((torch.randint(0x3C00, 0x4200, (4096,), generator=gen) << 16) | 0x8000).to(torch.int32).view(torch.float32)
    targets = targets * torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    masters = targets / decay
    hit = (masters * decay == targets) & ((masters.view(torch.int32) & 0xFFFF) != 0x8000)
    masters = masters[hit][:512]
    n = masters.numel()
    assert n > 100
    param = masters.to(torch.bfloat16).to(DEVICE)
    zeros = torch.zeros(n, device=DEVICE)
    state = C.encode_state(param, {"step": torch.tensor(3.0, device=DEVICE), "exp_avg": zeros,
                                   "exp_avg_sq": torch.full((n,), 1e-4, device=DEVICE),
                                   "master_param": masters.to(DEVICE)}, "split16")
    entry = (param, zeros.clone(), state)
    twins = check_step([entry], [("split16", torch.float32)])
    new_master = twins[0][2]["master_param"]
    assert torch.all((new_master.view(torch.int32) & 0xFFFF) == 0x8000), "every new master is a tie"
    joined = C.join16(entry[0], state["master_low16"])
    ulps = joined.view(torch.int32).long() - new_master.view(torch.int32).long()
    assert torch.all(ulps.abs() == 1), "a tie moves by one fp32 ulp"
    toward = (entry[0].float() - new_master).sign() * new_master.sign()  # param above (in magnitude) -> +1 ulp
    assert torch.equal(ulps.sign().float(), toward), "toward the param"


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES)
def test_skipped_step_writes_nothing(param_dtype, master_weights, state_dtype, n):
    entry = make(n, param_dtype, master_weights, state_dtype, amsgrad=True)
    before = clone(entry)
    triton_step([entry], amsgrad=True, skip=1.0, rounding_seed=5)
    assert_same_state(entry, before, "skipped")


def test_mixed_launch_with_grad_scale_write_back():
    """fp32, split16, bf16-moment, split8, int8 and plain bf16 tensors in one launch, each as the
    fp32 path steps it; the unscaled grads are written back."""
    configs = [(torch.float32, "fp32", torch.float32, 700), (torch.bfloat16, "split16", torch.float32, N),
               (torch.bfloat16, "fp32", torch.bfloat16, 300), (torch.float16, "split8", torch.bfloat16, 900),
               (torch.bfloat16, "split16", "int8", LARGE), (torch.bfloat16, "none", torch.float32, 257)]
    entries = [make(n, dt, mw, sd, seed=i) for i, (dt, mw, sd, n) in enumerate(configs)]
    grads = [e[1].clone() for e in entries]
    scale = torch.tensor(1024.0, device=DEVICE)
    inv_scale = float(1 / torch.tensor(1024.0, dtype=torch.float64))
    twins = check_step(entries, [(mw, sd) for _, mw, sd, _ in configs], factor=inv_scale, grad_scale=scale)
    for i, (entry, twin, grad) in enumerate(zip(entries, twins, grads)):
        same_bits(entry[1], twin[1], f"grad {i} written back")
        same_bits(entry[1], grad * torch.tensor(inv_scale, dtype=torch.float32), f"grad {i} unscaled")


# ------------------------------------------------------------------ stochastic rounding

def constant_entry(n, state_dtype):
    """Every element alike, zero grads: each write is one fp32 value strictly between two bf16 values
    (exp_avg 0.9: 0.4 of a bf16 ulp above the lower one, exp_avg_sq 0.999: 0.75), so round to
    nearest is biased and stochastic rounding must average to the fp32 value."""
    param = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    state = {"step": torch.tensor(4.0, device=DEVICE), "exp_avg": torch.ones(n, device=DEVICE).to(state_dtype),
             "exp_avg_sq": torch.ones(n, device=DEVICE).to(state_dtype)}
    return param, torch.zeros(n, device=DEVICE), state


def test_stochastic_rounding_is_unbiased_and_seeded():
    n = 4096
    exact = constant_entry(n, torch.float32)
    exact = (exact[0].float(), exact[1], exact[2])  # an fp32 param: the exact result of the param too
    spec_step(*exact)
    runs = []
    for seed in (11, 11, 12):
        entry = constant_entry(n, torch.bfloat16)
        triton_step([entry], rounding_seed=seed)
        runs.append(entry)
    for what, pick in (("exp_avg", lambda e: e[2]["exp_avg"]), ("exp_avg_sq", lambda e: e[2]["exp_avg_sq"]),
                       ("param", lambda e: e[0])):
        same_bits(pick(runs[0]), pick(runs[1]), f"{what}: the same seed, the same bits")
        assert not torch.equal(pick(runs[0]), pick(runs[2])), f"{what}: another seed gave the same bits"
        target = pick(exact)[0].item()
        low = torch.tensor(target).to(torch.bfloat16)
        low = low.float().item() if low.float().item() <= target else (low.view(torch.int16) - 1).view(torch.bfloat16).float().item()
        high = (torch.tensor(low).to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float().item()
        values = pick(runs[0]).float()
        assert torch.all((values == low) | (values == high)), f"{what}: SR gives one of the two neighbours"
        up = (values == high).double().mean().item()
        fraction = (target - low) / (high - low)
        assert 0.02 < fraction < 0.98, f"{what}: the test value should not be (nearly) representable"
        assert abs(up - fraction) < 4 * (fraction * (1 - fraction) / n) ** 0.5, (what, up, fraction)

    rne = constant_entry(n, torch.bfloat16)
    triton_step([rne])  # round to nearest: the spec bitwise
    spec_rne = constant_entry(n, torch.bfloat16)
    spec_step(*spec_rne)
    assert_same_state(rne, spec_rne, "RNE")


def test_stochastic_rounding_leaves_exact_masters_exact():
    """With a split16 master nothing is rounded: a seed changes no bit of param or master."""
    entry = make(N, torch.bfloat16, "split16", torch.float32)
    other = clone(entry)
    triton_step([entry], rounding_seed=3)
    triton_step([other])
    assert_same_state(entry, other, "split16 under SR")


def test_bad_compact_state_is_refused_before_writing():
    param, grad, state = make(LARGE, torch.bfloat16, "fp32", "int8")
    before = clone((param, grad, state))
    lists = lists_of([(param, grad, state)])
    stats = torch.tensor([0.0, 0.0, 1.0, 0.0], device=DEVICE)
    with pytest.raises(ValueError, match="moment_scales"):
        kernels.adamw_update_(batch_of({**lists, "moment_scales": None}, [0], [hyper()]), stats)
    with pytest.raises(TypeError, match="split16"):
        low = torch.zeros(LARGE, dtype=torch.int16, device=DEVICE)
        kernels.adamw_update_(batch_of({**lists, "params": [param.float()], "masters": [low]}, [0], [hyper()]), stats)
    assert_same_state((param, grad, state), before, "refused")


def test_compact_modes_declared():
    assert kernels.COMPACT_MODES == frozenset({"split16", "split8", "bf16", "int8", "sr"})
