"""The memory modes (DESIGN §9) in the loops users write, with torch.optim.AdamW on fp32 masters as the
oracle: autocast + the user's own clip_grad_norm_ + accumulation x4 + an LR scheduler, checkpoints
mid-run, param groups that change, state inspection, and the bad combinations.

A lossy mode's run walks away from the fp32 run (that is what lossy means),
so it is held to torch one step at a time: before each step its state is decoded
(``to_torch_state_dict``) into a torch.optim.AdamW over fp32 masters, which takes the same gradients;
after the step ampfused's state must be that torch step followed by the mode's encoding (``_compact``):
bit for bit on the reference backend, within one step of the encoding's grid elsewhere (the kernels
sum in another order, which can move a rounding across a grid point).
"""
import copy

import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused.checkpoint import to_torch_state_dict
from helpers import DEVICE, backends_among, equal_bits, same_bits, through_disk

MODES = [("fp32", None, False), ("split16", None, False), ("split8", None, False), (False, None, False),
         ("fp32", torch.bfloat16, False), ("split16", torch.bfloat16, True), ("fp32", "int8", False),
         ("split8", "int8", False), (False, torch.bfloat16, True), ("split16", "int4", False), (False, "int4", True)]
FEW = [MODES[i] for i in (1, 5, 7, 8, 9)]  # split16; bf16 moments + SR; split8 + int8; no master + SR; split16 + int4


def mode_id(mode):
    master_weights, state_dtype, stochastic = mode
    return f"{master_weights}-{str(state_dtype).replace('torch.', '')}{'-sr' if stochastic else ''}"


def modes_by_backend(*names):
    """(backend, mode): every mode on the reference backend (the oracle's own), the FEW on the others
    that are available (the Triton interpreter is slow: only where a test names it)."""
    have = backends_among(*names)
    return [pytest.param(b, m, id=f"{b}-{mode_id(m)}") for b in have for m in (MODES if b == "reference" else FEW)]


CHEAP = ("reference", "cpu")


class OddSizedNet(torch.nn.Module):
    """Odd sizes (not multiples of 256), a LayerNorm and biases under int8's / int4's 4096 threshold, one
    weight above it."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(24, 180)  # 4320 weights, rows of 24: int8 / int4 moments
        self.norm = torch.nn.LayerNorm(180)
        self.mid = torch.nn.Linear(180, 33)
        self.out = torch.nn.Linear(33, 5)

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.norm(torch.relu(self.inp(x))))))


def odd_sized_net(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return OddSizedNet().to(DEVICE, dtype)


def labelled_batch(step, micro):
    g = torch.Generator().manual_seed(step * 16 + micro)
    return torch.randn(8, 24, generator=g).to(DEVICE), torch.randint(0, 5, (8,), generator=g).to(DEVICE)


def accumulate_grads(model, step, accumulate=4, dtype=torch.bfloat16):
    for micro in range(accumulate):
        x, y = labelled_batch(step, micro)
        with torch.autocast(DEVICE.type, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y) / accumulate
        loss.backward()


def optimizer(params, mode, backend, **kw):
    master_weights, state_dtype, stochastic = mode
    kw = {"lr": 3e-3, "weight_decay": 0.1, **kw}
    return ampfused.FusedAmpAdamW(params, master_weights=master_weights, state_dtype=state_dtype,
                                  stochastic_rounding=stochastic, backend=backend, **kw)


def decoded(opt):
    """Every param's state in torch's fp32 form (with fp32 masters), as fresh tensors."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return copy.deepcopy(to_torch_state_dict(opt.state_dict(), params))


# ------------------------------------------------------------------ the per-step oracle


def torch_step(opt, before):
    """torch.optim.AdamW over fp32 masters, from ``before`` (``decoded(opt)`` before the step), on the
    gradients ``opt`` is about to read; returns {param: (master, state)} for the params that stepped."""
    groups, masters = [], {}
    for g, saved in zip(opt.param_groups, before["param_groups"]):
        ms = []
        for p, index in zip(g["params"], saved["params"]):
            entry = before["state"].get(index, {})
            m = torch.nn.Parameter(entry.get("master_param", p.detach().float()).clone())
            if p.grad is not None:
                m.grad = p.grad.detach().float().clone()
            masters[p] = m
            ms.append(m)
        groups.append({"params": ms})
    ref = torch.optim.AdamW(groups)
    ref.load_state_dict(copy.deepcopy(before))
    ref.step()
    return {p: (m.detach(), ref.state[m]) for p, m in masters.items() if m.grad is not None}


def grid_tol(backend, scale):
    return 0.0 if backend == "reference" else scale


def assert_encoded_torch_step(opt, expected, backend, stochastic):
    """After ``opt.step()``: each stepped param's state is the torch step (``torch_step``) encoded in the mode."""
    after = decoded(opt)
    index = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for p, (master, want) in expected.items():
        got, state = after["state"][index[p]], opt.state[p]
        assert torch.equal(got["step"], want["step"])
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key not in want:
                continue
            w, g = want[key], got[key]
            kind = "signed" if key == "exp_avg" else "sqrt"
            if key + "_codes" in state and C.moment_encoding(state["exp_avg_codes"]) == "int4":
                # int4: the torch moment encoded by the spec; elsewhere each code within one level of it
                codes, scales = C.quantize4(w, kind)
                if backend == "reference":
                    assert torch.equal(g, C.dequantize4(codes, scales, kind)), key
                else:
                    diff = (C.unpack4(state[key + "_codes"].cpu()) - C.unpack4(codes)).abs()
                    assert diff.max().item() <= 1, f"{key}: a code more than one level off"
                    torch.testing.assert_close(state[key + "_scales"].cpu(), scales, rtol=2e-5, atol=0, msg=key)
            elif key + "_codes" in state:  # int8: the torch moment quantized, within one code elsewhere
                enc = C.dequantize(*C.quantize(w, "signed" if key == "exp_avg" else "sqrt"), "signed" if key == "exp_avg" else "sqrt")
                rtol = grid_tol(backend, 2**-3 if key == "exp_avg" else 2**-3)
                torch.testing.assert_close(g, enc, rtol=rtol, atol=rtol * 2**-14 * w.abs().max().item(), msg=key)
            elif state[key].dtype == torch.bfloat16:  # bf16: RNE (SR: one of the two neighbours)
                if stochastic:
                    lo = C._from_bits16(C._bits(w) >> 16, torch.bfloat16).float()  # truncated toward zero
                    hi = C._from_bits16((C._bits(w) >> 16) + 1, torch.bfloat16).float()
                    ok = (g == w) | (g == lo) | (g == hi) | ((g - w).abs() <= 2**-7 * w.abs())
                    assert ok.all(), key
                else:
                    torch.testing.assert_close(g, w.to(torch.bfloat16).float(), rtol=grid_tol(backend, 2**-7), atol=0, msg=key)
            else:
                torch.testing.assert_close(g, w, rtol=grid_tol(backend, 2e-5), atol=grid_tol(backend, 2e-6), msg=key)
        if p.dtype == torch.float32:
            torch.testing.assert_close(p.detach(), master, rtol=grid_tol(backend, 2e-5), atol=grid_tol(backend, 2e-6))
        elif "master_param" in state:
            torch.testing.assert_close(got["master_param"], master, rtol=grid_tol(backend, 2e-5), atol=grid_tol(backend, 2e-6))
            assert torch.equal(p.detach(), got["master_param"].to(p.dtype))  # p = RNE(master), always
        elif "master_low16" in state:  # the torch master, but at ties (moved one fp32 ulp)
            want_master = C.join16(*C.split16(master))
            torch.testing.assert_close(got["master_param"], want_master, rtol=grid_tol(backend, 2e-5), atol=grid_tol(backend, 2e-6))
            assert torch.equal(p.detach(), got["master_param"].to(p.dtype))
        elif "master_residual8" in state:  # within ulp(p)/256 of the torch master
            ulp = C._scale_pow2(torch.ones_like(master), C._ulp_exponent(p.detach()))
            slack = 0 if backend == "reference" else 2e-5 * master.abs() + 2e-6
            assert ((got["master_param"] - master).abs() <= ulp / 256 + slack).all()
            if backend == "reference":
                assert torch.equal(got["master_param"], C.join8(*C.split8(master, p.dtype)))
        else:  # no master: the param is the torch master rounded (RNE, or SR to a neighbour)
            err = (p.detach().float() - master).abs()
            ulp = C._scale_pow2(torch.ones_like(master), C._ulp_exponent(p.detach()))
            if stochastic or backend != "reference":
                assert (err <= ulp + 2e-6).all()
            else:
                assert torch.equal(p.detach(), master.to(p.dtype))


# ------------------------------------------------------------------ 1. the tutorial trainer


def train_checked(model, opt, sched, steps, first=0, check=None, backend=None, stochastic=False):
    for step in range(first, first + steps):
        accumulate_grads(model, step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        expected = torch_step(opt, decoded(opt)) if check else None
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if check:
            assert_encoded_torch_step(opt, expected, backend, stochastic)


def one_cycle(opt, total=20):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=total)  # cycles betas[0] too


@pytest.mark.parametrize("backend,mode", modes_by_backend("reference", "cpu") + [
    pytest.param(b, MODES[7], id=f"{b}-{mode_id(MODES[7])}") for b in backends_among("triton")])
def test_tutorial_trainer_each_step_is_torch_adamw_then_the_encoding(backend, mode):
    model = odd_sized_net()
    opt = optimizer(model.parameters(), mode, backend)
    torch.manual_seed(3)
    train_checked(model, opt, one_cycle(opt), 3 if backend == "triton" else 5, check=True, backend=backend, stochastic=mode[2])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("backend", backends_among("reference", "triton"))
def test_tutorial_trainer_exact_modes_follow_an_independent_torch_loop(backend):
    """fp32 and split16 masters against a twin bf16 model trained by torch.optim.AdamW on fp32 masters
    (fp32 accumulation of the micro-batches, the user's clip, the scheduler): the same grads, params,
    masters and moments; bit for bit on the reference backend (split16: but at ties, which the twin
    applies too), and split16 bit for bit the fp32 run on every backend."""
    twin = odd_sized_net()
    masters = [torch.nn.Parameter(p.detach().float()) for p in twin.parameters()]
    ref = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.1)
    ref_sched = one_cycle(ref)
    runs = {}
    for mode in ("fp32", "split16"):
        model = odd_sized_net()
        opt = optimizer(model.parameters(), (mode, None, False), backend)
        runs[mode] = (model, opt, one_cycle(opt))
    for step in range(4):
        for model, opt, sched in runs.values():
            accumulate_grads(model, step)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for micro in range(4):  # the twin: fp32 accumulation by hand
            x, y = labelled_batch(step, micro)
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                (torch.nn.functional.cross_entropy(twin(x), y) / 4).backward()
            for m, p in zip(masters, twin.parameters()):
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        for (model, opt, _) in runs.values():
            for p, m in zip(model.parameters(), masters):
                exact = backend == "reference"
                torch.testing.assert_close(p.grad, m.grad, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-7)
        ref.step()
        ref_sched.step()
        ref.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(masters, twin.parameters()):
                m.copy_(C.join16(*C.split16(m)))  # the tie rule (a 2^-16 event per element)
                p.copy_(m)
        for model, opt, sched in runs.values():
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        (a, fp32, _), (b, split, _) = runs["fp32"], runs["split16"]
        for p, q, m in zip(a.parameters(), b.parameters(), masters):
            s, t = fp32.state[p], split.state[q]
            if backend == "reference":
                assert torch.equal(C.join16(*C.split16(s["master_param"])), m.detach())  # (both nudged at ties)
                assert torch.equal(s["exp_avg"], ref.state[m]["exp_avg"]) and torch.equal(s["exp_avg_sq"], ref.state[m]["exp_avg_sq"])
            else:
                torch.testing.assert_close(s["master_param"], m.detach(), rtol=1e-4, atol=1e-5)
            with torch.no_grad():
                s["master_param"].copy_(C.join16(*C.split16(s["master_param"])))
            assert torch.equal(p, q)
            assert torch.equal(C.join16(q.detach(), t["master_low16"]), s["master_param"])
            assert torch.equal(s["exp_avg"], t["exp_avg"]) and torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
            assert torch.equal(s["step"], t["step"])


def kept_bytes(model, mode):
    """DESIGN §9's bytes of the optimizer's tensors: state per param (int8 / int4 only from 4096 elements),
    the fp32 gradient storage of the masters' params, the step counters."""
    master_weights, state_dtype, _ = mode
    total = 0
    for p in model.parameters():
        n = p.numel()
        if state_dtype == "int8" and n >= C.SMALL_TENSOR_NUMEL:
            total += 2 * n + 2 * 4 * -(-n // C.BLOCK)
        elif state_dtype == "int4" and n >= C.SMALL_TENSOR_NUMEL and p.shape[-1] % 2 == 0:
            total += n + 2 * 4 * p.shape[0] * -(-(n // p.shape[0]) // C.BLOCK)  # two half-byte moments, scales per row
        else:
            total += n * (4 if state_dtype is torch.bfloat16 else 8)
        total += n * {"fp32": 4, "split16": 2, "split8": 1, False: 0}[master_weights]
        total += 4 * n if master_weights is not False else 0  # fp32 accumulation follows master weights
        total += 4  # step
    return total


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_state_bytes_are_the_documented_ones(mode):
    model = odd_sized_net()
    opt = optimizer(model.parameters(), mode, "reference")
    train_checked(model, opt, one_cycle(opt), 1)
    want = kept_bytes(model, mode)
    tensors = sum(1 for _ in model.parameters())
    assert want <= opt.state_bytes() <= want + 5 * 2 * 128 * tensors, (opt.state_bytes(), want)  # + 128-byte alignment


# ------------------------------------------------------------------ 2. checkpoints mid-run


def assert_same_run(model_a, opt_a, model_b, opt_b):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key in opt_a.state[p]:
            same_bits(opt_b.state[q][key], opt_a.state[p][key], key)


@pytest.mark.parametrize("backend,mode", modes_by_backend("reference", "cpu"))
def test_checkpoint_mid_run_continues_bitwise(backend, mode):
    model = odd_sized_net()
    opt = optimizer(model.parameters(), mode, backend)
    sched = one_cycle(opt)
    torch.manual_seed(4)
    train_checked(model, opt, sched, 2)
    ckpt = through_disk({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                      "rng": torch.get_rng_state()})
    train_checked(model, opt, sched, 2, first=2)

    model2 = odd_sized_net()
    model2.load_state_dict(ckpt["model"])
    opt2 = optimizer(model2.parameters(), mode, backend, lr=1.0)
    sched2 = one_cycle(opt2)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    torch.set_rng_state(ckpt["rng"])
    train_checked(model2, opt2, sched2, 2, first=2)
    assert_same_run(model, opt, model2, opt2)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


@pytest.mark.parametrize("torch_dtype,mode", [(torch.bfloat16, m) for m in MODES] + [(torch.float32, m) for m in FEW])
def test_torch_adamw_checkpoint_loads_into_each_mode_and_continues(mode, torch_dtype):
    """A run begun with torch.optim.AdamW (on an fp32 model, or on the bf16 model directly: bf16
    state) continues in every mode: the loaded state is torch's, encoded; the next steps follow torch."""
    model = odd_sized_net(torch_dtype)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = one_cycle(torch_opt)
    for step in range(3):
        accumulate_grads(model, step)
        torch_opt.step()
        sched.step()
        torch_opt.zero_grad()
    ckpt = through_disk({"model": model.state_dict(), "opt": torch_opt.state_dict(), "sched": sched.state_dict()})
    model2 = odd_sized_net()
    model2.load_state_dict(ckpt["model"])
    opt = optimizer(model2.parameters(), mode, "reference")
    sched2 = one_cycle(opt)
    opt.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"]
    start = decoded(opt)
    for i, p in enumerate(model2.parameters()):
        torch_state = ckpt["opt"]["state"][i]
        assert start["state"][i]["step"].item() == 3.0
        if mode[1] is None:  # fp32 moments: torch's values (bf16 ones widened exactly)
            assert torch.equal(start["state"][i]["exp_avg"], torch_state["exp_avg"].float())
        if mode[0] is not False:  # no master in torch's dict: the param is the master
            assert torch.equal(start["state"][i]["master_param"], p.detach().float())
    train_checked(model2, opt, sched2, 2, first=3, check=True, backend="reference", stochastic=mode[2])


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_to_torch_state_dict_continues_in_torch_and_in_fp32_mode(mode):
    model = odd_sized_net()
    opt = optimizer(model.parameters(), mode, "reference")
    sched = one_cycle(opt)
    torch.manual_seed(4)
    train_checked(model, opt, sched, 3)
    params = list(model.parameters())
    sd = opt.state_dict()
    torch_sd = through_disk(to_torch_state_dict(sd, params))
    ckpt_sched = sched.state_dict()
    # into torch.optim.AdamW over fp32 masters, and into ampfused's fp32 mode over a copy of the bf16 model
    masters = [torch.nn.Parameter(torch_sd["state"][i].get("master_param", p.detach().float()).clone()) for i, p in enumerate(params)]
    torch_opt = torch.optim.AdamW(masters)
    torch_opt.load_state_dict(torch_sd)
    fp32_model = odd_sized_net()
    fp32_model.load_state_dict(model.state_dict())
    fp32 = optimizer(fp32_model.parameters(), ("fp32", None, False), "reference")
    fp32_sched = one_cycle(fp32)  # (before the loads, as torch's recipe: it sets lr and betas)
    fp32.load_state_dict(torch_sd)
    fp32_sched.load_state_dict(ckpt_sched)
    train_checked(model, opt, sched, 1, first=3)
    accumulate_grads(fp32_model, 3)
    torch.nn.utils.clip_grad_norm_(fp32_model.parameters(), 1.0)
    for m, p in zip(masters, fp32_model.parameters()):
        m.grad = p.grad.float().clone()
    torch_opt.param_groups[0]["lr"] = fp32.param_groups[0]["lr"]  # (the scheduler drives fp32's)
    torch_opt.step()
    fp32.step()
    fp32_sched.step()
    for m, p, q in zip(masters, fp32_model.parameters(), model.parameters()):
        assert torch.equal(fp32.state[p]["master_param"], m.detach())  # the reference backend is torch's math
        assert torch.equal(fp32.state[p]["exp_avg"], torch_opt.state[m]["exp_avg"])
        if mode[:2] in (("fp32", None), ("split16", None)):  # exact modes: the same run as not converting
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p.float(), q.float(), rtol=2**-6, atol=1e-3)



def test_to_torch_state_dict_does_not_alias_the_live_state():
    """The converted dict holds copies: a torch.optim.AdamW that loads it in the same process (the
    docstring's example) and steps must not move ampfused's step counters or moments (torch keeps the
    fp32 tensors it loads onto fp32 params as they are, and increments ``step`` in place)."""
    model = odd_sized_net()
    opt = optimizer(model.parameters(), ("fp32", None, False), "reference")
    train_checked(model, opt, one_cycle(opt), 2)
    params = list(model.parameters())
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    torch_sd = to_torch_state_dict(opt.state_dict(), params)
    masters = [torch.nn.Parameter(torch_sd["state"][i]["master_param"].clone()) for i in range(len(params))]
    torch_opt = torch.optim.AdamW(masters)
    torch_opt.load_state_dict(torch_sd)
    for m in masters:
        m.grad = torch.ones_like(m)
    torch_opt.step()
    for p in params:
        for key, value in before[p].items():
            same_bits(opt.state[p][key], value, key)


def mode_pairs():
    picked = [("fp32", None, False), ("split16", None, False), ("split8", "int8", False), (False, torch.bfloat16, False),
              ("fp32", torch.bfloat16, False)]
    return [(a, b) for a in picked for b in picked if a != b]


@pytest.mark.parametrize("saved,loaded", mode_pairs(), ids=lambda m: f"{m[0]}-{str(m[1]).replace('torch.', '')}")
def test_switching_modes_across_a_checkpoint_works_or_is_refused_cleanly(saved, loaded):
    model = odd_sized_net()
    opt = optimizer(model.parameters(), saved, "reference")
    sched = one_cycle(opt)
    train_checked(model, opt, sched, 3)
    ckpt = through_disk({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    model2 = odd_sized_net()
    model2.load_state_dict(ckpt["model"])
    opt2 = optimizer(model2.parameters(), loaded, "reference", lr=0.5)
    sched2 = one_cycle(opt2)
    train_checked(model2, opt2, sched2, 1, first=7)  # state already there: a refused load must leave it
    before = {p: {k: v.clone() for k, v in opt2.state[p].items()} for p in model2.parameters()}
    params_before = [p.detach().clone() for p in model2.parameters()]
    lr_before = opt2.param_groups[0]["lr"]
    refuse = saved[0] in ("split16", "split8")  # compact keys (int8 comes with split8 here): only their own mode
    try:
        opt2.load_state_dict(ckpt["opt"])
        assert not refuse
    except ValueError as error:
        assert refuse
        assert "to_torch_state_dict" in str(error)
        assert all(torch.equal(p, q) for p, q in zip(model2.parameters(), params_before))
        for p in model2.parameters():
            assert opt2.state[p].keys() == before[p].keys()
            assert all(equal_bits(opt2.state[p][k], v) for k, v in before[p].items())
        assert opt2.param_groups[0]["lr"] == lr_before
        opt2.load_state_dict(to_torch_state_dict(ckpt["opt"], list(model.parameters())))  # the way it names
    sched2.load_state_dict(ckpt["sched"])
    start = decoded(opt2)
    want = to_torch_state_dict(ckpt["opt"], list(model.parameters()))
    for i, p in enumerate(model2.parameters()):
        assert start["state"][i]["step"].item() == 3.0
        if "master_param" in start["state"][i] and "master_param" in want["state"][i]:
            torch.testing.assert_close(start["state"][i]["master_param"], want["state"][i]["master_param"], rtol=2**-8, atol=0)
    train_checked(model2, opt2, sched2, 1, first=3, check=True, backend="reference")


# ------------------------------------------------------------------ 3. param groups


@pytest.mark.parametrize("backend,mode", modes_by_backend("reference", "cpu"))
def test_param_groups_freezing_and_late_params(backend, mode):
    """Two groups (lr, weight decay), a frozen group, a param with no grad on odd steps, a param
    unfrozen at step 5, a group added at step 3 (with a 0-element param), each step torch's."""
    model = odd_sized_net()
    extra = torch.nn.Parameter(torch.randn(300, 17, device=DEVICE).to(torch.bfloat16))  # added later
    empty = torch.nn.Parameter(torch.zeros(0, device=DEVICE, dtype=torch.bfloat16))
    model.norm.requires_grad_(False)  # frozen group
    model.inp.bias.requires_grad_(False)  # unfrozen at step 5
    decay = [model.inp.weight, model.mid.weight, model.out.weight]
    opt = optimizer([{"params": decay}, {"params": [model.inp.bias, model.mid.bias, model.out.bias], "lr": 1e-3, "weight_decay": 0.0},
                     {"params": list(model.norm.parameters()), "lr": 5e-3}], mode, backend)
    for step in range(8):
        if step == 3:
            opt.add_param_group({"params": [extra, empty], "lr": 2e-3})
        if step == 5:
            model.inp.bias.requires_grad_(True)
        accumulate_grads(model, step)
        if step >= 3:
            extra.grad = (torch.randn(extra.shape, generator=torch.Generator().manual_seed(step)) * 1e-2).to(DEVICE, extra.dtype)
            empty.grad = torch.zeros_like(empty)
        if step % 2:
            model.mid.bias.grad = None  # no grad this step: untouched, compact buffers included
        untouched = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in (model.mid.bias, model.inp.bias)}
        values = {p: p.detach().clone() for p in untouched}
        expected = torch_step(opt, decoded(opt))
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert_encoded_torch_step(opt, expected, backend, mode[2])
        for p in (model.mid.bias, model.inp.bias):
            if p not in expected:
                assert torch.equal(p, values[p])
                assert opt.state[p].keys() == untouched[p].keys()
                assert all(equal_bits(opt.state[p][k], v) for k, v in untouched[p].items())
        assert not opt.state[model.norm.weight]  # frozen: no state, as torch
    assert opt.state[model.inp.bias]["step"].item() == 3.0  # stepped from step 5
    assert opt.state[model.mid.bias]["step"].item() == 4.0
    assert opt.state[empty]["step"].item() == 5.0


@pytest.mark.parametrize("backend", backends_among(*CHEAP))
def test_group_added_mid_run_survives_a_checkpoint(backend):
    """A group added at step 2 in split8 + int8 (+ amsgrad): the resumed run adds it again before
    loading (as torch requires) and continues bit for bit, random rounding seeds included."""
    mode = ("split8", "int8", False)

    def make():
        model = odd_sized_net()
        extra = torch.nn.Parameter(torch.randn(300, 17, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.bfloat16))
        return model, extra, optimizer(model.parameters(), mode, backend, amsgrad=True)

    def extra_grad(extra, step):
        extra.grad = (torch.randn(extra.shape, generator=torch.Generator().manual_seed(step)) * 1e-2).to(DEVICE, extra.dtype)

    model, extra, opt = make()
    for step in range(6):
        if step == 2:
            opt.add_param_group({"params": [extra], "lr": 1e-3})
        accumulate_grads(model, step)
        if step >= 2:
            extra_grad(extra, step)
        opt.step()
        opt.zero_grad()
        if step == 3:
            ckpt = through_disk({"model": model.state_dict(), "extra": extra.detach().clone(), "opt": opt.state_dict()})
    model2, extra2, opt2 = make()
    model2.load_state_dict(ckpt["model"])
    with torch.no_grad():
        extra2.copy_(ckpt["extra"])
    opt2.add_param_group({"params": [extra2], "lr": 5.0})
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.param_groups[1]["lr"] == 1e-3
    for step in range(4, 6):
        accumulate_grads(model2, step)
        extra_grad(extra2, step)
        opt2.step()
        opt2.zero_grad()
    assert_same_run(model, opt, model2, opt2)
    assert torch.equal(extra, extra2)
    assert opt.state[extra].keys() == opt2.state[extra2].keys()
    assert all(equal_bits(opt.state[extra][k], opt2.state[extra2][k]) for k in opt.state[extra])


# ------------------------------------------------------------------ 4. what users do with the optimizer


@pytest.mark.parametrize("mode", [MODES[0]] + FEW, ids=mode_id)
def test_state_inspection_deepcopy_and_reset(mode):
    model = odd_sized_net()
    opt = optimizer(model.parameters(), mode, "reference")
    sched = one_cycle(opt)
    train_checked(model, opt, sched, 2)
    for p in model.parameters():  # logging code
        state = opt.state[p]
        assert state["step"].dtype == torch.float32 and state["step"].dim() == 0 and state["step"].item() == 2.0
        key = "exp_avg" if "exp_avg" in state else "exp_avg_codes"
        # (int4 codes are two a byte along the last dimension: [note: int4 packing])
        packed = key == "exp_avg_codes" and C.moment_encoding(state[key]) == "int4"
        assert state[key].shape == (C.packed_shape(p.shape) if packed else p.shape)
    copied = copy.deepcopy(opt)
    copied_params = [p for g in copied.param_groups for p in g["params"]]
    frozen = {i: {k: v.clone() for k, v in copied.state[q].items()} for i, q in enumerate(copied_params)}
    torch.manual_seed(1)
    train_checked(model, opt, sched, 1, first=2)
    for i, q in enumerate(copied_params):  # stepping the original leaves the copy
        assert all(equal_bits(copied.state[q][k], v) for k, v in frozen[i].items())
    # reset: the next step is a fresh optimizer's on the current weights
    opt.state.clear()
    fresh_model = odd_sized_net()
    fresh_model.load_state_dict(model.state_dict())
    fresh = optimizer(fresh_model.parameters(), mode, "reference")
    for o in (opt, fresh):
        o.param_groups[0]["lr"] = 1e-3
        o.param_groups[0]["betas"] = (0.9, 0.999)
    for m, o in ((model, opt), (fresh_model, fresh)):
        torch.manual_seed(2)
        accumulate_grads(m, 9)
        o.step()
        o.zero_grad()
    assert_same_run(model, opt, fresh_model, fresh)
    assert opt.state[next(model.parameters())]["step"].item() == 1.0


def torch_step_unscaled(opt, scale):
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = p.grad.float() / scale
    try:
        return torch_step(opt, decoded(opt))
    finally:
        for p, g in zip(params, saved):
            p.grad = g


@pytest.mark.parametrize("backend,state_dtype", [("reference", None), ("reference", torch.bfloat16)] + [
    (b, "int8") for b in backends_among(*CHEAP)])
def test_fp16_split8_with_grad_scaler_and_an_overflow_step(backend, state_dtype):
    """fp16 model, split8 masters, ampfused.GradScaler (every other step through unscale_ and the user's
    clip_grad_norm_): each step torch's on the unscaled gradients, which p.grad holds afterwards (as
    torch's fused AdamW leaves it); an overflowing step changes no buffer at all and backs off."""
    model = odd_sized_net(torch.float16)
    opt = optimizer(model.parameters(), ("split8", state_dtype, False), backend)
    scaler = ampfused.GradScaler(DEVICE.type, init_scale=2.0**10)
    for step in range(4):
        for micro in range(2):
            x, y = labelled_batch(step, micro)
            with torch.autocast(DEVICE.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
        if step == 2:
            model.out.bias.grad[0] = float("inf")
        before = {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in model.parameters()}
        scale = scaler.get_scale()
        if step % 2:  # torch's AMP recipe with the user's own clipping: unscale_, clip, step
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            want_grads = {p: p.grad.clone() for p in model.parameters()}
            expected = torch_step(opt, decoded(opt))
        else:
            want_grads = {p: p.grad.clone() / scale for p in model.parameters()}
            expected = None if step == 2 else torch_step_unscaled(opt, scale)
        scaler.step(opt)
        scaler.update()
        for p in model.parameters():
            if step == 2:
                assert torch.equal(p, before[p][0])
                assert all(equal_bits(opt.state[p][k], v) for k, v in before[p][1].items())
            else:
                torch.testing.assert_close(p.grad, want_grads[p], rtol=grid_tol(backend, 1e-6), atol=0)
        if expected is not None:
            assert_encoded_torch_step(opt, expected, backend, False)
        opt.zero_grad(set_to_none=True)
    assert scaler.get_scale() == 2.0**9
    assert scaler.skipped_steps == 1


# ------------------------------------------------------------------ 5. combinations


@pytest.mark.parametrize("master_weights", ["split16", "split8"])
def test_split_masters_leave_fp32_params_their_own_master(master_weights):
    """DESIGN §9: master_weights applies to fp16/bf16 params; fp32 params (a LayerNorm kept in fp32, as
    mixed-precision recipes do) keep no master and step as torch (each step); split16 is still the fp32
    run bit for bit."""
    runs = []
    for mw in ("fp32", master_weights):
        model = odd_sized_net()
        model.norm.float()
        opt = optimizer(model.parameters(), (mw, None, False), "reference")
        train_checked(model, opt, one_cycle(opt), 3, check=True, backend="reference")
        runs.append((model, opt))
    (a, fp32), (b, split) = runs
    for p, q in zip(a.norm.parameters(), b.norm.parameters()):
        assert set(split.state[q]) == {"step", "exp_avg", "exp_avg_sq"}
        if master_weights == "split16":
            assert torch.equal(p, q)
            assert all(equal_bits(fp32.state[p][k], split.state[q][k]) for k in split.state[q])


@pytest.mark.parametrize("master_weights", ["split16", "split8"])
def test_split_masters_on_an_fp32_model_are_the_fp32_mode_and_say_so(master_weights):
    """An all-fp32 model has no 16-bit param for a split master: nothing to refuse (DESIGN §9: fp32
    params are their own master); the run is the default one bit for bit, the same bytes are kept, and
    repr says that no param has a split master."""
    runs = []
    for mw in (None, master_weights):
        model = odd_sized_net(torch.float32)
        if mw is None:
            opt = optimizer(model.parameters(), (mw, None, False), "reference")
        else:  # and warns that the option does nothing here (issue 36 item 3)
            with pytest.warns(ampfused.UnusedOptionWarning, match=f'master_weights="{mw}" has no effect'):
                opt = optimizer(model.parameters(), (mw, None, False), "reference")
        train_checked(model, opt, one_cycle(opt), 2)
        runs.append((model, opt))
    assert_same_run(*runs[0], *runs[1])
    assert runs[0][1].state_bytes() == runs[1][1].state_bytes()
    assert f"{master_weights} master weights: 0 of 0 fp16/bf16 params" in repr(runs[1][1])


def test_int8_moments_with_amsgrad_follow_torch():
    model = odd_sized_net()
    opt = optimizer(model.parameters(), ("split8", "int8", False), "reference", amsgrad=True)
    train_checked(model, opt, one_cycle(opt), 4, check=True, backend="reference")
    assert "max_exp_avg_sq_codes" in opt.state[model.inp.weight]


@pytest.mark.parametrize("kwargs,match", [
    (dict(master_weights="FP32"), "master_weights"),
    (dict(master_weights="split"), "master_weights"),
    (dict(master_weights="bf16"), "master_weights"),
    (dict(state_dtype="bf16"), "state_dtype"),
    (dict(state_dtype="bfloat16"), "state_dtype"),
    (dict(state_dtype=torch.float16), "state_dtype"),
    (dict(state_dtype="INT8"), "state_dtype"),
    (dict(state_dtype=torch.int8), "state_dtype"),
])
def test_unknown_mode_strings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ampfused.FusedAmpAdamW(odd_sized_net().parameters(), **kwargs)


def test_split16_fp16_group_added_later_is_refused_before_any_write():
    model = odd_sized_net()
    opt = optimizer(model.parameters(), ("split16", None, False), "reference")
    train_checked(model, opt, one_cycle(opt), 1)
    groups = len(opt.param_groups)
    half = torch.nn.Parameter(torch.randn(40, device=DEVICE).half())
    with pytest.raises(ValueError, match="split8"):
        opt.add_param_group({"params": [half]})
    assert len(opt.param_groups) == groups
    train_checked(model, opt, one_cycle(opt), 1, first=1)


@pytest.mark.parametrize("source", ["torch", "ampfused"])
def test_empty_state_entries_of_peeked_params_load_and_convert(source):
    """``opt.state`` is a defaultdict: logging code that reads ``opt.state[p]`` of a param that never
    stepped (frozen) leaves an empty entry, which state_dict() writes; torch loads such dicts."""
    model = odd_sized_net()
    model.norm.requires_grad_(False)
    params = list(model.parameters())
    if source == "torch":
        opt = torch.optim.AdamW(params, lr=3e-3)
    else:
        opt = optimizer(params, ("split8", "int8", False), "reference")
    accumulate_grads(model, 0)
    opt.step()
    assert not opt.state[model.norm.weight]  # the peek: an empty entry
    sd = through_disk(opt.state_dict())
    assert sd["state"][2] == {}
    converted = to_torch_state_dict(sd, params)
    assert converted["state"][2] == {}
    torch.optim.AdamW(params).load_state_dict(converted)
    model2 = odd_sized_net()
    model2.load_state_dict(model.state_dict())
    for mode in (("split8", "int8", False), ("fp32", None, False)):
        opt2 = optimizer(model2.parameters(), mode, "reference")
        opt2.load_state_dict(sd if mode[0] == "split8" or source == "torch" else converted)
        assert not opt2.state.get(list(model2.parameters())[2])
        model2.norm.requires_grad_(True)
        accumulate_grads(model2, 1)
        opt2.step()
        assert opt2.state[list(model2.parameters())[2]]["step"].item() == 1.0
        model2.zero_grad(set_to_none=True)
