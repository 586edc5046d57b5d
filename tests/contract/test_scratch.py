"""Per-optimizer launch scratch, and the fresh-grads fast path of the step plan.

The last program of a stats or update launch is found with a ticket counter, and the stats pass adds
per-program partials: both belong to one optimizer (``functional.Scratch``), never to a table that
every optimizer with the same tensor sizes shares. Two optimizers of identical sizes stepping
alternately must each equal an independent run; on a GPU also on two streams and in two graphs.

With ``zero_grad(set_to_none=True)`` every step brings new grad tensors; the plan then re-reads only
their dtypes, contiguity and addresses (the Triton tables patch their address column), so every
step must still match the reference, and a grad that changes its layout must still be caught.
"""
import math

import pytest
import torch

import ampfused
from helpers import DEVICE, assert_states_close, clone_params, make_params

SHAPES = [(2500,), (7, 5), (33,), (300,)]  # identical in both models; 2500 spans several chunks


def grads_of(params, step, seed):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [(torch.randn(p.shape, generator=g) * 4096.0).to(DEVICE) for p in params]


def run_alone(params, options, scaled, steps, seed, bad_step=None):
    """One optimizer (on the reference backend) stepped alone: the oracle of the alternating run."""
    opt = ampfused.FusedAmpAdamW(params, backend="reference", **options)
    scaler = ampfused.GradScaler(DEVICE.type, init_scale=4096.0) if scaled else None
    for k in range(steps):
        apply_grads(params, grads_of(params, k, seed), k == bad_step)
        scaled_step(opt, scaler)
    return opt


def apply_grads(params, grads, bad):
    for p, g in zip(params, grads):
        p.grad = g  # new tensors every step, as zero_grad(set_to_none=True) + backward give
    if bad:
        params[0].grad.view(-1)[5] = math.inf


def scaled_step(opt, scaler):
    if scaler is None:
        opt.step()
    else:
        scaler.scale(torch.ones((), device=DEVICE))  # what scaler.scale(loss) does first: the scale tensor
        scaler.step(opt)
        scaler.update()


def test_two_optimizers_of_identical_sizes_step_alternately(backend):
    options = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    steps, bad_step = 5, 2  # a's step 2 is skipped: b must not see its flag, nor its partials
    a_params, b_params = make_params(SHAPES, device=DEVICE, seed=1), make_params(SHAPES, device=DEVICE, seed=2)
    a_ref = run_alone(clone_params(a_params), options, True, steps, seed=1, bad_step=bad_step)
    b_ref_params = clone_params(b_params)
    b_ref = run_alone(b_ref_params, options, False, steps, seed=2)
    a_ref_params = [p for g in a_ref.param_groups for p in g["params"]]

    a = ampfused.FusedAmpAdamW(a_params, backend=backend, **options)
    b = ampfused.FusedAmpAdamW(b_params, backend=backend, **options)
    scaler = ampfused.GradScaler(DEVICE.type, init_scale=4096.0)
    for k in range(steps):
        apply_grads(a_params, grads_of(a_params, k, 1), k == bad_step)
        scaled_step(a, scaler)
        apply_grads(b_params, grads_of(b_params, k, 2), False)
        scaled_step(b, None)
        assert math.isfinite(float(b.grad_norm)), f"step {k}: b skipped"
        assert math.isfinite(float(a.grad_norm)) == (k != bad_step), f"step {k}: a's skip decision"
    assert_states_close(a_ref, a_ref_params, a, a_params, backend)
    assert_states_close(b_ref, b_ref_params, b, b_params, backend)
    assert scaler.skipped_steps == 1
    assert a._scratch.buffer(DEVICE).data_ptr() != b._scratch.buffer(DEVICE).data_ptr()


def test_fresh_grads_every_step_match_reference(backend):
    """New grad tensors each step, some at odd addresses or with a changed layout, against the reference."""
    shapes = [(2500,), (2, 3, 4, 5), (33,), (300,)]
    params = make_params(shapes, device=DEVICE, seed=3)
    params[1] = params[1].detach().to(memory_format=torch.channels_last).requires_grad_()
    ref_params = clone_params(params)
    ref_params[1] = ref_params[1].detach().to(memory_format=torch.channels_last).requires_grad_()
    options = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, amsgrad=True)
    opt = ampfused.FusedAmpAdamW(params, backend=backend, **options)
    ref = ampfused.FusedAmpAdamW(ref_params, backend="reference", **options)
    for k in range(6):
        grads = grads_of(params, k, 3)
        for ps, o in ((params, opt), (ref_params, ref)):
            for i, (p, g) in enumerate(zip(ps, grads)):
                g = g.clone().to(memory_format=torch.channels_last) if g.dim() == 4 else g.clone()
                if k == 2 and i == 0:  # an address 4 bytes past an aligned one: the alignment flag must follow
                    g = torch.empty(g.numel() + 1, device=DEVICE)[1:].copy_(g)
                if k == 4 and i == 2:  # same shape, gaps in memory: the plan must re-validate it
                    g = torch.empty(2 * g.numel(), device=DEVICE)[::2].copy_(g)
                if k == 5 and i == 1:  # contiguous where the param is channels_last: other strides
                    g = g.contiguous()
                p.grad = g
            o.step()
        assert_states_close(ref, ref_params, opt, params, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_two_optimizers_on_two_streams_and_in_two_graphs(backend):
    from test_gpu import require

    require(backend)
    options = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, backend=backend)
    shapes = [(1 << 20,), (4097,), (33, 3)] * 4  # enough blocks that two launches overlap on the device
    models = [make_params(shapes, device="cuda", seed=s) for s in (1, 2)]
    eager = [clone_params(m) for m in models]
    opts = [ampfused.FusedAmpAdamW(m, **options) for m in models]
    eager_opts = [ampfused.FusedAmpAdamW(m, **options) for m in eager]
    static = [[torch.zeros_like(p) for p in m] for m in models]
    for m, grads in zip(models, static):
        for p, g in zip(m, grads):
            p.grad = g

    def load(k):
        for s, (m, grads) in enumerate(zip(eager, static)):
            for p, g, new in zip(m, grads, grads_of(m, k, s)):
                g.copy_(new)
                p.grad = new

    def eager_steps():  # the oracle: one after the other on the current stream
        for o in eager_opts:
            o.step()

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for k in range(3):  # eager, each optimizer on its own stream, concurrently
        load(k)
        for s, o in zip(streams, opts):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                o.step()
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        eager_steps()
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    for g, s, o in zip(graphs, streams, opts):
        with torch.cuda.graph(g, stream=s):
            o.step()
    for k in range(3, 9):  # two graphs replayed concurrently on two streams
        load(k)
        for g, s in zip(graphs, streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                g.replay()
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        eager_steps()
    torch.cuda.synchronize()
    for o, m, eo, em in zip(opts, models, eager_opts, eager):
        for p, pe in zip(m, em):
            assert torch.equal(p.detach(), pe.detach())
            for key, value in eo.state[pe].items():
                assert torch.equal(o.state[p][key], value), key
        assert float(o.state[m[0]]["step"]) == 9.0
