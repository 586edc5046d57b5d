"""Every backend's compact update (split16 / split8 masters, bf16 and int8 moments) against the
specification ``ampfused._compact.compact_adamw_step_``, on the same cases for every backend (the
``kernel`` fixture, tests/compact/conftest.py).

The backend's ``adamw_update_`` is called with hand-built lists (the tensors of ``_compact``'s state
dicts). Round-to-nearest modes are held bit for bit to the same backend's fp32 path on the decoded
state with its results encoded by the specification (the "twin"; split16 also to the fp32-master
path outright), and close to the specification's own step (torch ops: its fp32 division by a scalar
is not correctly rounded, tests/contract/test_passes.py), bitwise in the moments where the backend
says so (``Kernel.spec_bitwise``).
"""
import pytest
import torch

from ampfused import _compact as C
from ampfused import reference
from ampfused._batch import Hyper
from helpers import UPDATE_MODES, assert_close_to_spec, assert_same_state, check_step, clone_compact, compact_hyper
from helpers import compact_update, same_bits, spec_step

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the Triton interpreter's numpy


def test_compact_modes_declared(kernel):
    assert kernel.backend.COMPACT_MODES == frozenset({"split16", "split8", "bf16", "int8", "int4", "sr"})


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,size", UPDATE_MODES)
def test_round_to_nearest_modes(kernel, param_dtype, master_weights, state_dtype, size, amsgrad):
    """Two steps, the second from the first one's compact state (errors never compound differently):
    a grad in the param's dtype with maximize (with AMSGrad), then an fp32 grad."""
    n = kernel.size(size, state_dtype)
    param, grad, state = kernel.entry(n, param_dtype, master_weights, state_dtype, amsgrad, seed=3)
    if state_dtype == "int8" and n < C.SMALL_TENSOR_NUMEL:
        assert "exp_avg_codes" not in state and state["exp_avg"].dtype == torch.float32
    first = float(state["step"])
    for step, (grad_dtype, maximize, factor) in enumerate([(param_dtype, amsgrad, 0.5), (torch.float32, False, 0.75)]):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(50 + step)).to(grad_dtype).to(kernel.device)
        check_step(kernel, [(param, grad, state)], [(master_weights, state_dtype)], amsgrad=amsgrad, maximize=maximize,
                   factor=factor)
    assert float(state["step"]) == first + 2


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype", [
    (torch.bfloat16, "split16", torch.bfloat16), (torch.float16, "split8", torch.float32),
    (torch.bfloat16, "split16", "int8"), (torch.bfloat16, "none", torch.bfloat16)])
def test_unaligned_views_take_the_element_path(kernel, param_dtype, master_weights, state_dtype):
    entry = kernel.entry(kernel.size("n", state_dtype), param_dtype, master_weights, state_dtype, amsgrad=True, offset=1)
    check_step(kernel, [entry], [(master_weights, state_dtype)], amsgrad=True)


def test_two_work_units_of_int8_state(cuda_kernel):
    """Past one 65536-element chunk with int8 moments (the emulation's other sizes stay within one)."""
    kernel = cuda_kernel
    entry = kernel.entry(kernel.unit + 300, torch.bfloat16, "split16", "int8", amsgrad=True)
    check_step(kernel, [entry], [("split16", "int8")], amsgrad=True, maximize=True, factor=0.5)


def test_mixed_launch_with_grad_scale_write_back(kernel):
    """fp32, split16, bf16-moment, split8, int8, below-threshold and plain bf16 tensors in one
    launch, each as the fp32 path steps it; the unscaled grads are written back."""
    small = C.SMALL_TENSOR_NUMEL - 1
    configs = [(torch.float32, "fp32", torch.float32, 700), (torch.bfloat16, "split16", torch.float32, kernel.n),
               (torch.bfloat16, "fp32", torch.bfloat16, 300), (torch.float16, "split8", torch.bfloat16, 900),
               (torch.bfloat16, "split16", "int8", kernel.size("n", "int8")), (torch.bfloat16, "split8", "int8", small),
               (torch.bfloat16, "none", torch.float32, 257), (torch.float32, "fp32", "int8", 4096 + 255)]
    entries = [kernel.entry(n, dt, mw, sd, seed=i) for i, (dt, mw, sd, n) in enumerate(configs)]
    grads = [e[1].clone() for e in entries]
    scale = torch.tensor(1000.0, device=kernel.device)  # not a power of two: the unscale rounds
    inv_scale = float(1 / torch.tensor(1000.0, dtype=torch.float64))
    twins = check_step(kernel, entries, [(mw, sd) for _, mw, sd, _ in configs], factor=inv_scale, grad_scale=scale)
    for i, (entry, twin, grad) in enumerate(zip(entries, twins, grads)):
        same_bits(entry[1], twin[1], f"grad {i} written back")
        same_bits(entry[1], grad * torch.tensor(inv_scale, dtype=torch.float32), f"grad {i} unscaled")


def spread(kernel, i, state_dtype):
    """The i-th size of a many-tensor launch: different tails (int8 moments from SMALL_TENSOR_NUMEL on)."""
    if kernel.n >= 65536:
        return 3000 + 517 * i
    return C.SMALL_TENSOR_NUMEL + 37 * i if state_dtype == "int8" else 300 + 37 * i


def test_mixed_list_with_grad_scale_and_two_groups(kernel):
    """fp32-path and compact tensors of every mode in one call, in two groups, each equal to its twin and
    close to the spec; grads unscaled in place."""
    hypers = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False), Hyper(3e-3, 0.8, 0.99, 1e-6, 0.0, True, True)]
    layout = [(torch.float32, "fp32", torch.float32), (torch.bfloat16, "fp32", torch.float32)] + [
        m.values[:3] for m in UPDATE_MODES if m.values[3] == "n"]
    entries, groups = [], []
    for i, (dtype, mw, sd) in enumerate(layout):
        n = spread(kernel, i, sd)
        group = i % 2
        param, grad, state = kernel.entry(n, dtype, mw, sd, hypers[group].amsgrad, seed=40 + i)
        entries.append((param, grad.to(torch.float32 if i % 3 == 0 else dtype), state))
        groups.append(group)
    grads = [e[1].clone() for e in entries]
    scale = torch.tensor([1024.0], device=kernel.device)
    inv = scale.double().reciprocal().float().cpu()
    check_step(kernel, entries, [m[1:] for m in layout], hypers=hypers, group_ids=groups, factor=float(inv) * 0.5,
               grad_scale=scale)
    for i, (entry, g) in enumerate(zip(entries, grads)):
        same_bits(entry[1].cpu(), (g.cpu().float() * inv).to(g.dtype), f"tensor {i}: unscaled grad")


def test_int8_moments_with_a_tensor_lr_and_maximize(kernel):
    """A 0-d tensor lr (read by the op) and maximize on int8 moments, against the spec with the same float lr."""
    lr = torch.tensor(3e-3, dtype=torch.float64, device=kernel.device)
    native = kernel.entry(9000, torch.bfloat16, "split16", "int8", amsgrad=True, seed=90)
    spec = clone_compact(native)
    kernel.step([native], hypers=[Hyper(lr, 0.9, 0.999, 1e-8, 0.01, True, True)], factor=2.0)
    spec_step(*spec, Hyper(3e-3, 0.9, 0.999, 1e-8, 0.01, True, True), factor=2.0)
    assert_close_to_spec(kernel, native, spec, "tensor lr")


def test_reference_is_the_oracle_of_the_lossy_modes(kernel):
    """The same entries stepped natively and by the reference passes (``ampfused.reference``) on copies."""
    entries = [kernel.entry(kernel.size("n", "int8"), torch.bfloat16, "split8", "int8", amsgrad=True, seed=8),
               kernel.entry(900, torch.float16, "split8", torch.bfloat16, amsgrad=True, seed=9)]
    copies = [clone_compact(e) for e in entries]
    kernel.step(entries, amsgrad=True, factor=0.5)
    compact_update(reference, copies, amsgrad=True, factor=0.5)
    for i, (a, b) in enumerate(zip(entries, copies)):
        assert_close_to_spec(kernel, a, b, f"tensor {i}")


# ------------------------------------------------------------------ split16 = the fp32-master path


@pytest.mark.parametrize("amsgrad", [False, True])
def test_split16_equals_the_fp32_master_path(kernel, amsgrad):
    """Each step from the same master (the split one, decoded): params, moments and step bitwise; the
    master too but at ties, where the split master sits one fp32 ulp toward the param."""
    n = 3 * kernel.n if kernel.n < 65536 else kernel.n
    split = kernel.entry(n, torch.bfloat16, "split16", torch.float32, amsgrad=amsgrad, seed=3)
    hypers = [Hyper(1e-3, 0.9, 0.99, 1e-8, 0.1, amsgrad, True)]
    for step in range(4):
        fp32 = (split[0].clone(), split[1].clone(), {k: t.clone() for k, t in C.decode_state(split[2], split[0]).items()})
        grad = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(kernel.device)
        grad = grad.to(torch.bfloat16) if step % 2 else grad
        split = (split[0], grad.clone(), split[2])
        fp32 = (fp32[0], grad.clone(), fp32[2])
        factor = 1.25 if step % 2 else 1.0
        kernel.step([split], hypers=hypers, factor=factor)
        kernel.step([fp32], hypers=hypers, factor=factor)
        same_bits(split[0], fp32[0], "param")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            assert (key in split[2]) == (key in fp32[2]), key
            if key in fp32[2]:
                same_bits(split[2][key], fp32[2][key], key)
        joined = C.join16(split[0], split[2]["master_low16"])
        master = fp32[2]["master_param"]
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        same_bits(joined[~tie], master[~tie], "master (no tie)")
        ulps = (joined[tie].view(torch.int32).long() - master[tie].view(torch.int32).long()).abs()
        assert bool((ulps == 1).all()), "a tie's master moves by exactly one fp32 ulp"  # rare here: see the next tests


def test_split16_tie_rule(kernel):
    """New masters with the low half 0x8000 (weight decay alone: zero grads and exp_avg) are stored
    one fp32 ulp toward the param, as the specification says; the param is the fp32 path's."""
    hyper = compact_hyper()
    decay = torch.tensor(1 - hyper.lr * hyper.weight_decay, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    targets = ((torch.randint(0x3C00, 0x4200, (4096,), generator=gen) << 16) | 0x8000).to(torch.int32).view(torch.float32)
    targets = targets * torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    masters = targets / decay
    hit = (masters * decay == targets) & ((masters.view(torch.int32) & 0xFFFF) != 0x8000)
    masters = masters[hit][:512]
    n = masters.numel()
    assert n > 100
    device = kernel.device
    param = masters.to(torch.bfloat16).to(device)
    zeros = torch.zeros(n, device=device)
    state = C.encode_state(param, {"step": torch.tensor(3.0, device=device), "exp_avg": zeros,
                                   "exp_avg_sq": torch.full((n,), 1e-4, device=device),
                                   "master_param": masters.to(device)}, "split16")
    entry = (param, zeros.clone(), state)
    twins = check_step(kernel, [entry], [("split16", torch.float32)])
    new_master = twins[0][2]["master_param"]
    assert torch.all((new_master.view(torch.int32) & 0xFFFF) == 0x8000), "every new master is a tie"
    joined = C.join16(entry[0], state["master_low16"])
    ulps = joined.view(torch.int32).long() - new_master.view(torch.int32).long()
    assert torch.all(ulps.abs() == 1), "a tie moves by one fp32 ulp"
    toward = (entry[0].float() - new_master).sign() * new_master.sign()  # param above (in magnitude) -> +1 ulp
    assert torch.equal(ulps.sign().float(), toward), "toward the param"


def test_split16_ties_keep_the_param_rne_and_move_the_master_one_ulp(kernel):
    """Zero moments and gradient: the new master is w * (1 - lr*wd) exactly; masters that land on ties
    among ordinary ones, against the spec bitwise."""
    lr, wd = 1e-3, 0.5
    decay = torch.tensor(1 - lr * wd, dtype=torch.float32)
    candidates = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5))
    candidates = C.join16(*C.split16(candidates))  # representable as split16
    lands = ((candidates * decay).view(torch.int32) & 0xFFFF) == 0x8000
    w = torch.cat([candidates[lands], candidates[:4096]])
    assert int(lands.sum()) > 4
    param, low = C.split16(w)
    zeros = torch.zeros_like(w)
    state = {"step": torch.tensor(0.0), "exp_avg": zeros.clone(), "exp_avg_sq": zeros.clone(), "master_low16": low}
    native = (param.to(kernel.device), torch.zeros_like(param).to(kernel.device),
              {k: t.to(kernel.device) for k, t in state.items()})
    spec = clone_compact(native)
    hyper = Hyper(lr, 0.9, 0.999, 1e-8, wd, False, False)
    kernel.step([native], hypers=[hyper])
    spec_step(*spec, hyper)
    assert_same_state(native, spec, "ties")
    exact = w * decay
    same_bits(native[0].cpu(), exact.to(torch.bfloat16), "param = RNE(exact master)")
    moved = (C.join16(native[0], native[2]["master_low16"]).cpu().view(torch.int32).long()
             - exact.view(torch.int32).long()).abs()
    tie = (exact.view(torch.int32) & 0xFFFF) == 0x8000
    assert bool((moved[tie] == 1).all()) and bool((moved[~tie] == 0).all())
