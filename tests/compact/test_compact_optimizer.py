"""FusedAmpAdamW in the compact modes (DESIGN §9), on every backend: split16 is the fp32-master run
bit for bit, each lossy mode is the reference backend's run of the same mode, skipped steps keep
every compact buffer, checkpoints round-trip and convert, and the kept bytes are measured.

[note: oracle] A backend that lists a mode in its ``COMPACT_MODES`` runs it natively and is held
to its own fp32 run (split16) or within a stated tolerance of the reference (lossy modes); any
other backend hands those tensors to the reference passes inside its step, so its compact tensors
must equal the reference backend's bit for bit.
"""
import copy
import io
import math
import pickle

import pytest
import torch

import ampfused
from ampfused import _backends
from ampfused import _compact as C
from ampfused.checkpoint import to_torch_state_dict
from ampfused._state import master_of, moment_key
from ampfused.reference import is_compact
from helpers import DEVICE, assert_bitwise_equal, snapshot, tol

SIZES = (4096 + 300, 1000, 17)  # one tensor with int8 moments (>= SMALL_TENSOR_NUMEL), two small ones
SCALE = 1024.0  # a power of two: unscaling is exact on every backend
MODES = [("fp32", None), ("split16", None), ("split8", None), (False, None), ("fp32", torch.bfloat16),
         ("fp32", "int8"), ("split16", torch.bfloat16), ("split8", "int8"), (False, "int8"), (False, torch.bfloat16)]
LOSSY = [m for m in MODES if m not in (("fp32", None), ("split16", None))]


def needed(master_weights, state_dtype, stochastic=False):
    modes = {"split16": {"split16"}, "split8": {"split8"}}.get(master_weights, set())
    modes |= {torch.bfloat16: {"bf16"}, "int8": {"int8"}}.get(state_dtype, set())
    if stochastic:
        modes.add("sr")
    return modes


def native(backend, modes) -> bool:
    return set(modes) <= getattr(_backends.resolve(backend, DEVICE)[0], "COMPACT_MODES", frozenset())


def make_params(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(n, generator=g) / 4).to(dtype).to(DEVICE)) for n in SIZES]


def clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def feed(opt, params, step, bad=False):
    """Scaled gradients (as a GradScaler leaves them) for ``step``; ``bad`` poisons one element."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g) * SCALE
        if bad and i == 0:
            grad[123] = math.inf
        p.grad = grad.to(p.dtype).to(DEVICE)
    opt.grad_scale = torch.tensor(SCALE, device=DEVICE)  # torch's scaler protocol (_step_supports_amp_scaling)


def run(opt, params, steps, bad_steps=(4,), first=0):
    for step in range(first, first + steps):
        feed(opt, params, step, bad=step in bad_steps)
        opt.step()
        opt.zero_grad()


def full_state(opt, params):
    """Every param's state decoded to fp32 (and its master), through the public converter."""
    sd = to_torch_state_dict(opt.state_dict(), params)
    return [sd["state"][i] for i in range(len(params))]


# ------------------------------------------------------------------ split16 = fp32 masters


@pytest.mark.parametrize("amsgrad", [False, True])
def test_split16_is_the_fp32_master_run_bitwise(backend, amsgrad):
    own = native(backend, {"split16"})
    fp32_backend = backend if own else "reference"
    # clipping moves the factor with the norm, whose last bits depend on the backend's summation
    # order: it is active only where both runs sum on the same backend
    clip = 1.0 if own or backend == "reference" else 1e9
    a = make_params()
    b = clone(a)
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
    n = SIZES[0]
    high = torch.randint(0x3C00, 0x3F00, (n,), generator=g, dtype=torch.int64)
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
    own = native(backend, {"split16"})
    fp32 = ampfused.FusedAmpAdamW([q], lr=1e-2, backend=backend if own else "reference")
    fp32_form["state"][0]["master_param"] = stored.clone()
    fp32.load_state_dict(fp32_form)
    for opt_, params in ((opt, [p]), (fp32, [q])):
        feed(opt_, params, 0)
        opt_.step()
    assert torch.equal(p, q)
    assert torch.equal(C.join16(p.detach(), opt.state[p]["master_low16"]), C.join16(*C.split16(fp32.state[q]["master_param"])))


# ------------------------------------------------------------------ lossy modes = the reference's


@pytest.mark.parametrize("master_weights,state_dtype,stochastic", [m + (False,) for m in LOSSY] + [
    (False, torch.bfloat16, True), ("split8", torch.bfloat16, True)])
def test_lossy_mode_is_the_reference_run_of_that_mode(backend, master_weights, state_dtype, stochastic):
    kw = dict(lr=1e-2, amsgrad=True, master_weights=master_weights, state_dtype=state_dtype,
              stochastic_rounding=stochastic, max_grad_norm=1e9)
    runs = []
    for name in (backend, "reference"):
        params = make_params()
        opt = ampfused.FusedAmpAdamW(params, backend=name, **kw)
        torch.manual_seed(7)  # the rounding seeds
        run(opt, params, 8)
        runs.append((opt, params))
    (opt, params), (ref, ref_params) = runs
    if not native(backend, needed(master_weights, state_dtype, stochastic)):
        for p, q in zip(params, ref_params):
            assert opt.state[p].keys() == ref.state[q].keys()
            state = opt.state[p]
            if is_compact(p, state[moment_key(state, "exp_avg")], master_of(state), "exp_avg_scales" in state or None, stochastic):
                assert torch.equal(p, q)  # served by the reference passes: the same bits
                for key in state:
                    assert torch.equal(state[key], ref.state[q][key]), key
            else:  # (a small tensor under "int8" keeps fp32 state: the backend's own kernel steps it)
                torch.testing.assert_close(p.float(), q.float(), rtol=2**-7, atol=0)  # one bf16 ulp
                for key in state:
                    torch.testing.assert_close(state[key], ref.state[q][key], **tol(backend), msg=key)
        return
    # a native variant: fp32 arithmetic in another order (and its own random bits) moves a code or a
    # bf16 ulp here and there; the decoded state stays within the encodings' resolution
    # a param without master under SR is rounded with other random bits at each of the 8 steps: the
    # two runs walk apart by up to one bf16 ulp (2^-7 relative) per step
    rtol = 8 * 2**-7 if stochastic and master_weights is False else 2e-2
    for p, q, s, t in zip(params, ref_params, full_state(opt, params), full_state(ref, ref_params)):
        torch.testing.assert_close(p.float(), q.float(), rtol=rtol, atol=1e-3)
        for key in s:
            # with SR the two runs' moments take other random roundings at each step: up to 8 bf16 ulps of
            # the tensor's scale apart (an element near zero has a tiny ulp but inherits the earlier ones)
            atol = 8 * 2**-8 * t[key].float().abs().max().item() if stochastic else 1e-6
            torch.testing.assert_close(s[key].float(), t[key].float(), rtol=1.5e-1, atol=atol, msg=key)


def test_stochastic_rounding_is_reproducible_and_unbiased(backend):
    """The same torch seed gives the same bits; SR of bf16 params without master follows the fp32 run on average."""
    ends = []
    for _ in range(2):
        params = [torch.nn.Parameter(torch.full((8192,), 1.0, device=DEVICE).to(torch.bfloat16))]
        opt = ampfused.FusedAmpAdamW(params, lr=1e-4, weight_decay=0.0, master_weights=False,
                                     stochastic_rounding=True, backend=backend)
        torch.manual_seed(11)
        for _ in range(20):
            params[0].grad = torch.ones_like(params[0])
            opt.step()
        ends.append(params[0].detach().clone())
    assert torch.equal(ends[0], ends[1])
    # each step moves the param by lr = 1e-4 (Adam's unit step), far below half a bf16 ulp at 1.0 (2^-8):
    # RNE would never move it; SR moves it by 20 * 1e-4 on average
    mean = ends[0].float().mean().item()
    assert abs(mean - (1.0 - 20e-4)) < 3e-4


# ------------------------------------------------------------------ skipped steps


@pytest.mark.parametrize("master_weights,state_dtype", MODES)
def test_skipped_step_keeps_every_compact_buffer_bitwise(backend, master_weights, state_dtype):
    params = make_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, amsgrad=True, max_grad_norm=1.0, master_weights=master_weights,
                                 state_dtype=state_dtype, stochastic_rounding=state_dtype is torch.bfloat16,
                                 backend=backend)
    run(opt, params, 3, bad_steps=())
    before = snapshot(opt, params)
    feed(opt, params, 99, bad=True)
    grads = [p.grad.clone() for p in params]
    opt.step()
    assert opt.step_skipped.item() == 1.0
    assert_bitwise_equal(before, snapshot(opt, params))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # still scaled, as torch leaves them


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("master_weights,state_dtype", MODES)
def test_state_dict_round_trips_bitwise(backend, master_weights, state_dtype):
    kw = dict(lr=1e-2, amsgrad=True, master_weights=master_weights, state_dtype=state_dtype, backend=backend)
    params = make_params()
    opt = ampfused.FusedAmpAdamW(params, **kw)
    run(opt, params, 3)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    for i, entry in enumerate(saved["opt"]["state"].values()):  # the documented keys of the mode
        assert set(entry) == {"step"} | set(opt._state_room.keys(params[i], True)), entry.keys()
    restored_params = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    restored = ampfused.FusedAmpAdamW(restored_params, **kw)
    restored.load_state_dict(saved["opt"])
    for p, q in zip(params, restored_params):
        assert opt.state[p].keys() == restored.state[q].keys()
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], restored.state[q][key]), key
    torch.manual_seed(5)
    run(opt, params, 2, first=10)
    torch.manual_seed(5)
    run(restored, restored_params, 2, first=10)
    assert all(torch.equal(p, q) for p, q in zip(params, restored_params))


@pytest.mark.parametrize("master_weights,state_dtype", MODES)
def test_torch_adamw_state_dict_loads_into_every_mode(backend, master_weights, state_dtype):
    params = make_params()
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
    run(opt, params, 0)  # (no step: state_dict() takes pending masters from the params)
    for i, (p, decoded) in enumerate(zip(params, full_state(opt, params))):
        want = torch_sd["state"][i]
        assert decoded["step"].item() == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            if state_dtype is None or (state_dtype == "int8" and p.numel() < C.SMALL_TENSOR_NUMEL):
                assert torch.equal(decoded[key], want[key])
            elif state_dtype is torch.bfloat16:
                assert torch.equal(decoded[key], want[key].to(torch.bfloat16).float())
            else:
                torch.testing.assert_close(decoded[key], want[key], rtol=0.13, atol=1e-3 * want[key].abs().max().item())
        if master_weights is not False:  # a torch state has no master: the param is the master, exactly
            assert torch.equal(decoded["master_param"], p.detach().float())
    run(opt, params, 2)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("master_weights,state_dtype", MODES)
def test_to_torch_state_dict_loads_into_torch_adamw(backend, master_weights, state_dtype):
    params = make_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, master_weights=master_weights, state_dtype=state_dtype, backend=backend)
    run(opt, params, 3)
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
    fp32 = ampfused.FusedAmpAdamW(clone(params), lr=1e-2, backend=backend)
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
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_mismatched_compact_mode_is_refused_before_any_write(backend):
    params = make_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, master_weights="split8", state_dtype="int8", backend=backend)
    run(opt, params, 2)
    sd = opt.state_dict()
    other_params = clone(params)
    other = ampfused.FusedAmpAdamW(other_params, lr=0.5, master_weights="split16", backend=backend)
    run(other, other_params, 1)
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


# ------------------------------------------------------------------ options


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(master_weights="split4"), ValueError, "master_weights"),
    (dict(master_weights="fp16"), ValueError, "master_weights"),
    (dict(state_dtype=torch.float16), ValueError, "state_dtype"),
    (dict(state_dtype="int4"), ValueError, "state_dtype"),
    (dict(stochastic_rounding=1), TypeError, "stochastic_rounding"),
])
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ampfused.FusedAmpAdamW(make_params(), **kwargs)


def test_split16_refuses_fp16_params():
    params = make_params() + [torch.nn.Parameter(torch.randn(10, device=DEVICE).half())]
    with pytest.raises(ValueError, match="split8"):
        ampfused.FusedAmpAdamW(params, master_weights="split16")
    opt = ampfused.FusedAmpAdamW(make_params(), master_weights="split16")
    with pytest.raises(ValueError, match="bf16"):
        opt.add_param_group({"params": [params[-1]]})
    ampfused.FusedAmpAdamW(params, master_weights="split8")  # fp16 params take split8


def test_functional_api_checks_compact_lists():
    p = torch.randn(4096, device=DEVICE).half()
    z = torch.zeros(4096, device=DEVICE)
    with pytest.raises(ValueError, match="split16 needs bf16"):
        ampfused.functional.fused_amp_adamw([p], [p.clone()], [z], [z.clone()], [None], [torch.zeros(())],
                                            [torch.zeros(4096, dtype=torch.int16)], lr=1e-3, beta1=0.9, beta2=0.999,
                                            eps=1e-8, weight_decay=0.0)
    codes = torch.zeros(4096, dtype=torch.int8)
    with pytest.raises(ValueError, match="moment_scales"):
        ampfused.functional.fused_amp_adamw([p], [p.clone()], [codes], [codes.view(torch.uint8)], [None], [torch.zeros(())],
                                            [None], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def test_functional_api_steps_compact_state_as_the_optimizer():
    params = make_params()
    opt = ampfused.FusedAmpAdamW(clone(params), lr=1e-2, master_weights="split8", state_dtype="int8", backend="reference")
    run(opt, opt.param_groups[0]["params"], 1, bad_steps=())
    state = [C.init_state(p.detach(), "split8", "int8") for p in params]
    feed(opt, params, 0)
    ampfused.functional.fused_amp_adamw(
        [p.detach() for p in params], [p.grad for p in params],
        [s.get("exp_avg_codes", s.get("exp_avg")) for s in state], [s.get("exp_avg_sq_codes", s.get("exp_avg_sq")) for s in state],
        [None] * 3, [s["step"] for s in state], [s["master_residual8"] for s in state],
        moment_scales=[(s["exp_avg_scales"], s["exp_avg_sq_scales"], None) if "exp_avg_scales" in s else None for s in state],
        grad_scale=torch.tensor(SCALE), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, backend="cpu")
    for p, q, s in zip(params, opt.param_groups[0]["params"], state):
        assert torch.equal(p, q)
        for key, value in s.items():
            assert torch.equal(value, opt.state[q][key]), key


@pytest.mark.parametrize("master_weights,state_dtype", [("split16", torch.bfloat16), ("split8", "int8")])
def test_options_survive_repr_pickle_and_deepcopy(master_weights, state_dtype):
    params = make_params()
    opt = ampfused.FusedAmpAdamW(params, master_weights=master_weights, state_dtype=state_dtype, stochastic_rounding=True,
                                 backend="reference")
    run(opt, params, 2)
    text = repr(opt)
    assert f"{master_weights} master weights" in text and "stochastic_rounding: True" in text
    assert ("int8" if state_dtype == "int8" else "bfloat16") in text
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert (copied.master_weights, copied.state_dtype, copied.stochastic_rounding) == (master_weights, state_dtype, True)
        new_params = copied.param_groups[0]["params"]
        for p, q in zip(params, new_params):
            for key in opt.state[p]:
                assert torch.equal(opt.state[p][key], copied.state[q][key])
        run(copied, new_params, 1)


# ------------------------------------------------------------------ bytes kept


KEPT = {  # DESIGN §9: param 2 + master + moments + gradient (4 fp32-accumulated, 2 read directly), bf16 params
    ("fp32", None): 2 + 4 + 8, ("split16", None): 2 + 2 + 8, ("split8", None): 2 + 1 + 8, (False, None): 2 + 8,
    ("fp32", torch.bfloat16): 2 + 4 + 4, ("split16", torch.bfloat16): 2 + 2 + 4, ("split8", torch.bfloat16): 2 + 1 + 4,
    ("split8", "int8"): 2 + 1 + 2 + 8 / C.BLOCK, (False, "int8"): 2 + 2 + 8 / C.BLOCK,
}


@pytest.mark.parametrize("fp32_accumulation", [True, False])
@pytest.mark.parametrize("mode", list(KEPT))
def test_state_bytes_measure_each_mode(mode, fp32_accumulation):
    master_weights, state_dtype = mode
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 256)).to(DEVICE, torch.bfloat16)
    params = [p for p in model.parameters() if p.numel() >= 4096]  # tensors >= 4096 elements (biases are not)
    opt = ampfused.FusedAmpAdamW(params, master_weights=master_weights, state_dtype=state_dtype,
                                 fp32_grad_accumulation=fp32_accumulation, backend="reference")
    model(torch.randn(4, 256, device=DEVICE, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    numel = sum(p.numel() for p in params)
    grads = 0 if fp32_accumulation else sum(p.grad.nbytes for p in params)  # autograd's, read directly
    kept = (sum(p.nbytes for p in params) + grads + opt.state_bytes()) / numel
    expected = KEPT[mode] + (4 if fp32_accumulation else 2)
    assert expected <= kept <= expected + 0.02, (kept, expected)  # (+ the step counters and 128-byte alignment)
    if mode == ("split8", "int8"):
        assert kept <= (9 if fp32_accumulation else 7) + 8 / C.BLOCK + 0.02
