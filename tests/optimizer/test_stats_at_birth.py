"""Stats at the gradient's birth (``ampfused/_main_grad.py`` [note: stats at birth]).

The CPU accumulation of fp16/bf16 gradients into fp32 storage leaves, per param, a record of what
the stats pass would compute from it; the cpu backend's stats pass takes the record instead of
reading a gradient nobody edited since. Oracle of every test: the same backend with the records off
(``AMPFUSED_STATS_AT_BIRTH=0``), which must give the same bits -- norm, clip coefficient, every param
and state tensor. Other backends ignore the records. A record that a step used is marked used
(slot 0 = -1), which is how the tests see whether the read was skipped.
"""
import pytest
import torch

import ampfused
from ampfused import _compiled
from ampfused._main_grad import STATS_AT_BIRTH_ENV
from helpers import DEVICE, assert_params_close

# cpu: several 65536-element ranges with tails, a tensor under one 2048-element block, one of exactly one
# range; the other backends (the Triton interpreter is slow) only need to show that they ignore records
CPU_SIZES = (70_000, 3_001, 17, 65_536, 131_077)
OTHER_SIZES = (3_001, 17, 300)
LR = 1e-2

needs_cpu_hook = pytest.mark.skipif(
    DEVICE.type != "cpu" or _compiled.load()[0] is None,
    reason="the records are written by the CPU accumulation hook of ampfused._C (a CPU test device with the "
           "extension built)")
pytestmark = needs_cpu_hook


def sizes(backend):
    return CPU_SIZES if backend == "cpu" else OTHER_SIZES


def make(records: bool, backend: str, monkeypatch, clip=None, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.1).to(dtype)) for n in sizes(backend)]
    monkeypatch.setenv(STATS_AT_BIRTH_ENV, "1" if records else "0")
    opt = ampfused.FusedAmpAdamW(params, lr=LR, max_grad_norm=clip, backend=backend)
    monkeypatch.delenv(STATS_AT_BIRTH_ENV)
    assert bool(opt.main_grads.records) == records
    return params, opt


def micro_batches(count, dtype=torch.bfloat16, seed=1, backend="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(n, generator=gen) * 0.05).to(dtype) for n in sizes(backend)] for _ in range(count)]


def backward(params, grads):
    """A real backward that only accumulates: autograd's AccumulateGrad nodes run the optimizer's hooks."""
    torch.autograd.backward(params, grads)


def record_state(opt, params):
    """Per param: 'fresh' (written by the last accumulation, valid), 'used' (a step took it) or 'stale'."""
    out = []
    for p in params:
        slot = int(opt.main_grads.records[p][0])
        out.append("used" if slot == -1 else "fresh" if slot == p.main_grad._version else "stale")
    return out


def results(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [opt.state[p][k].clone() for k in ("master_param", "exp_avg", "exp_avg_sq", "step")]
    return out


def assert_same_bits(a, b):
    for x, y in zip(a, b, strict=True):  # (NaNs included)
        assert x.dtype == y.dtype and torch.equal(x.flatten().view(torch.uint8), y.flatten().view(torch.uint8))


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("clip", [None, 1e-3])
def test_untouched_gradients_skip_the_stats_read_with_the_same_bits(backend, monkeypatch, count, clip):
    on, opt_on = make(True, backend, monkeypatch, clip)
    off, opt_off = make(False, backend, monkeypatch, clip)
    for step in range(3):
        batches = micro_batches(count, seed=step, backend=backend)
        for grads in batches:
            backward(on, grads)
            backward(off, grads)
        assert record_state(opt_on, on) == ["fresh"] * len(on)
        opt_on.step()
        opt_off.step()
        # the cpu backend took every record; the others read the gradients as before
        assert record_state(opt_on, on) == ["used" if backend == "cpu" else "fresh"] * len(on)
        assert torch.equal(opt_on.grad_norm, opt_off.grad_norm)
        assert_same_bits(results(opt_on, on), results(opt_off, off))
        opt_on.zero_grad()
        opt_off.zero_grad()
    # and both are the optimizer of the reference backend (fp32 masters: bf16 params may round apart)
    gen = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)) for n in sizes(backend)]
    opt_ref = ampfused.FusedAmpAdamW(ref, lr=LR, max_grad_norm=clip, backend="reference")
    for step in range(3):
        for grads in micro_batches(count, seed=step, backend=backend):
            backward(ref, grads)
        opt_ref.step()
        opt_ref.zero_grad()
    masters = lambda opt, params: [opt.state[p]["master_param"] for p in params]  # noqa: E731
    assert_params_close(masters(opt_ref, ref), masters(opt_on, on), backend)


def test_the_record_stands_in_for_the_read(monkeypatch):
    """Evidence that the read is skipped: an edit that bumps no version (through ``.data``) is not seen."""
    params, opt = make(True, "cpu", monkeypatch)
    backward(params, micro_batches(1)[0])
    expected = torch.stack([p.grad.double().square().sum() for p in params]).sum().sqrt().float()
    params[0].grad.data.mul_(4)  # no version bump: the documented limit of the records
    opt.step()
    torch.testing.assert_close(opt.grad_norm, expected, rtol=1e-6, atol=0)


def _clip(params, opt):
    torch.nn.utils.clip_grad_norm_(params, 1e-3)


def _edit_one(params, opt):
    params[1].grad.mul_(0.5)


def _replace_one(params, opt):
    params[1].grad = params[1].grad.clone()


def _ddp_like(params, opt):
    # what a DDP comm hook does to a bucket view of the gradient: average in place
    for p in params:
        p.grad.div_(2)


EDITS = {"clip_grad_norm_": (_clip, "all"), "in-place edit": (_edit_one, 1), "p.grad replaced": (_replace_one, 1),
         "ddp-like average": (_ddp_like, "all")}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("clip", [None, 1e-3])
def test_edited_gradients_fall_back_for_that_param_only(backend, monkeypatch, edit, clip):
    fn, which = EDITS[edit]
    on, opt_on = make(True, backend, monkeypatch, clip)
    off, opt_off = make(False, backend, monkeypatch, clip)
    for grads in micro_batches(2, backend=backend):
        backward(on, grads)
        backward(off, grads)
    fn(on, opt_on)
    fn(off, opt_off)
    opt_on.step()
    opt_off.step()
    state = record_state(opt_on, on)
    # the cpu backend took the record of every param but the edited ones; no other backend takes any
    assert [s == "used" for s in state] == [backend == "cpu" and which != "all" and i != which for i in range(len(on))], state
    assert torch.equal(opt_on.grad_norm, opt_off.grad_norm)
    assert_same_bits(results(opt_on, on), results(opt_off, off))


def test_cleared_in_place_and_reaccumulated_gradients_use_fresh_records(monkeypatch):
    """``zero_grad(set_to_none=False)`` bumps every version; the next micro-batches record again."""
    on, opt_on = make(True, "cpu", monkeypatch, 1e-3)
    off, opt_off = make(False, "cpu", monkeypatch, 1e-3)
    for step in range(3):
        for grads in micro_batches(2, seed=step):
            backward(on, grads)
            backward(off, grads)
        opt_on.step()
        opt_off.step()
        assert record_state(opt_on, on) == ["used"] * len(on)
        opt_on.zero_grad(set_to_none=False)
        opt_off.zero_grad(set_to_none=False)
    assert_same_bits(results(opt_on, on), results(opt_off, off))


def test_a_step_without_a_new_backward_reads_the_gradients(monkeypatch):
    """A record serves one step: a second step on the same gradients reads them (same bits)."""
    on, opt_on = make(True, "cpu", monkeypatch, 1e-3)
    off, opt_off = make(False, "cpu", monkeypatch, 1e-3)
    backward(on, micro_batches(1)[0])
    backward(off, micro_batches(1)[0])
    for _ in range(2):
        opt_on.step()
        opt_off.step()
        assert torch.equal(opt_on.grad_norm, opt_off.grad_norm)
    assert_same_bits(results(opt_on, on), results(opt_off, off))


def test_unscaled_gradients_are_read(monkeypatch):
    """``GradScaler.unscale_`` edits every gradient in place *without* bumping its version
    (``torch._amp_foreach_non_finite_check_and_unscale_``): a step under a scaler never takes records."""
    on, opt_on = make(True, "cpu", monkeypatch, 1e-3)
    off, opt_off = make(False, "cpu", monkeypatch, 1e-3)
    scalers = [ampfused.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    for params, opt, scaler in ((on, opt_on, scalers[0]), (off, opt_off, scalers[1])):
        scaler.scale(torch.ones(()))  # (sets the scale up, as scaling a loss does)
        for grads in micro_batches(2):
            backward(params, [g * 256 for g in grads])
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert "used" not in record_state(opt_on, on)
    assert_same_bits(results(opt_on, on), results(opt_off, off))


def test_scaled_steps_read_the_gradients(monkeypatch):
    """The records hold unscaled squares: a step with a loss scale reads every gradient."""
    on, opt_on = make(True, "cpu", monkeypatch, 1e-3, dtype=torch.float16)
    off, opt_off = make(False, "cpu", monkeypatch, 1e-3, dtype=torch.float16)
    scalers = [ampfused.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    for params, opt, scaler in ((on, opt_on, scalers[0]), (off, opt_off, scalers[1])):
        scaler.scale(torch.ones(()))
        for grads in micro_batches(2, dtype=torch.float16):
            backward(params, [g * 256 for g in grads])
        scaler.step(opt)
        scaler.update()
    assert "used" not in record_state(opt_on, on)
    assert_same_bits(results(opt_on, on), results(opt_off, off))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", [0, 1])  # the micro-batch that carries it
def test_a_nonfinite_micro_batch_skips_the_step(backend, monkeypatch, value, which):
    on, opt_on = make(True, backend, monkeypatch, 1e-3)
    off, opt_off = make(False, backend, monkeypatch, 1e-3)
    for params, opt in ((on, opt_on), (off, opt_off)):  # a first good step, so that there is state to keep
        backward(params, micro_batches(1, seed=9, backend=backend)[0])
        opt.step()
        opt.zero_grad()
    before = results(opt_on, on)
    batches = micro_batches(2, backend=backend)
    batches[which][2][5] = value
    for grads in batches:
        backward(on, grads)
        backward(off, grads)
    opt_on.step()
    opt_off.step()
    assert not torch.isfinite(opt_on.grad_norm) and not torch.isfinite(opt_off.grad_norm)
    assert_same_bits(results(opt_on, on), before)
    assert_same_bits(results(opt_off, off), before)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_accumulation_is_recorded_or_read(monkeypatch):
    """With create_graph autograd accumulates (out of place) instead of the hook; the result keeps its bits."""
    on, opt_on = make(True, "cpu", monkeypatch, 1e-3)
    off, opt_off = make(False, "cpu", monkeypatch, 1e-3)
    x = [torch.randn(n).to(torch.bfloat16) for n in CPU_SIZES]
    for params in (on, off):
        for k in range(3):
            loss = sum((p * xi).float().sum() * (k + 1) for p, xi in zip(params, x))
            loss.backward(create_graph=(k == 1))
    opt_on.step()
    opt_off.step()
    assert torch.equal(opt_on.grad_norm, opt_off.grad_norm)
    assert_same_bits(results(opt_on, on), results(opt_off, off))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("first", [True, False])
def test_recorded_sums_are_the_stats_pass_bits(dtype, first):
    """The op level: every size class, special values included (inf, NaN, overflow to inf, subnormals)."""
    ops = torch.ops.ampfused
    gen = torch.Generator().manual_seed(3)
    for n in (1, 15, 2048, 2049, 65_536, 65_537, 200_003):
        for special in (None, float("inf"), float("nan"), 3e38, 1e-40):
            main = torch.randn(n, generator=gen) * 7
            grad = (torch.randn(n, generator=gen) * 3).to(dtype)
            if special is not None:
                grad[n // 2] = special
            record = torch.full((3 + -(-n // 65_536),), -1, dtype=torch.int64)
            ops._accumulate_and_record(main, grad, record, first)
            assert int(record[0]) == main._version
            for clip in (None, 1.0):
                expected, got = torch.empty(4), torch.empty(4)
                ops.grad_stats([main], None, None, clip, expected)
                record[0] = main._version
                ops._grad_stats_recorded([main], [record], None, clip, got)
                assert int(record[0]) == -1, "the record was not taken"
                assert_same_bits([got], [expected])
