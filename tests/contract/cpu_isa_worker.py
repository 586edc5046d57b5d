"""The three CPU passes on fixed inputs, for tests/contract/test_cpu_isa.py, run as a subprocess.

usage: cpu_isa_worker.py OUT.pt   (the ISA comes from AMPFUSED_CPU_ISA, read when ampfused._C loads)

Runs accumulate, grad_stats and adamw_update of the cpu backend over every param/grad dtype pair,
sizes that leave block tails, and inputs with special values (NaN payloads of both signs, inf,
fp16 subnormals, values that round to inf), then a few optimizer steps in each compact state mode,
and saves every output with the ISA that ran them.
"""
import sys

import torch

import ampfused
from ampfused import _backends, _compiled
from ampfused._batch import Batch, Hyper

OUT = sys.argv[1]
cpu = _backends.resolve("cpu", torch.device("cpu"))[0]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (1, 7, 8, 519, 2049, 65537 + 13)


def special_values(n, dtype, gen):
    """n values of dtype: random normals, with NaN payloads, infs and subnormals spread in."""
    x = torch.randn(n, generator=gen) * 3
    bits = torch.tensor([0x7FC00000, -0x00400000, 0x7FA00001, 0x7FFFFFFF, -0x007EDCBB, 0x7F802000], dtype=torch.int32)
    specials = torch.cat([bits.view(torch.float32),
                          torch.tensor([float("inf"), -float("inf"), 6e-8, -3e-5, 65519.0, 65520.0, 1e-40, -0.0])])
    where = torch.randperm(n, generator=gen)[: min(n, len(specials))]
    x[where] = specials[: len(where)]
    return x.to(dtype) if dtype != torch.float32 else x


def main():
    gen = torch.Generator().manual_seed(0)
    out = {"isa": _compiled.load()[0].CPU_ISA}
    for gd in DTYPES:
        for n in SIZES:
            grad = special_values(n, gd, gen)
            dst = torch.randn(n, generator=gen)
            cpu.accumulate_(dst, grad)
            out[f"acc-{gd}-{n}"] = dst
        grads = [(torch.randn(n, generator=gen) * 5).to(gd) for n in SIZES]
        for scale in (None, torch.tensor([1024.0])):
            stats = torch.zeros(4)
            cpu.grad_stats_(Batch.of_grads(grads), scale, None, 1.0, stats)
            out[f"stats-{gd}-{scale is not None}"] = stats
        stats = torch.zeros(4)
        cpu.grad_stats_(Batch.of_grads([special_values(5000, gd, gen)[1000:]]), None, None, None, stats)  # non-finite: skip flag
        out[f"stats-bad-{gd}"] = stats
    for pd in DTYPES:
        for gd in DTYPES:
            for master in ((False, True) if pd != torch.float32 else (False,)):
                for amsgrad in (False, True):
                    params = [special_values(n, torch.float32, gen).to(pd) for n in SIZES]
                    grads = [special_values(n, torch.float32, gen).to(gd) for n in SIZES]  # inf / NaN too
                    m = [torch.randn(n, generator=gen) * 0.1 for n in SIZES]
                    v = [torch.rand(n, generator=gen) * 0.01 for n in SIZES]
                    for g, x in zip(grads, v):  # sqrt(v) = 0: the division's special case
                        g[::11] = 0
                        x[::11] = 0
                    vmax = [x + 0.001 for x in v] if amsgrad else [None] * len(SIZES)
                    steps = [torch.tensor(float(i)) for i in range(len(SIZES))]
                    masters = [special_values(n, torch.float32, gen) for n in SIZES] if master else [None] * len(SIZES)
                    hyper = Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, amsgrad, False)
                    cpu.adamw_update_(Batch(params, grads, m, v, vmax, steps, masters, [0] * len(SIZES), [hyper]),
                                      torch.tensor([0.0, 0.0, 0.5, 0.0]))
                    key = f"upd-{pd}-{gd}-{master}-{amsgrad}"
                    out[key] = [params, m, v, vmax, steps, masters]
    # lr 0, no decay: the param is exactly master.to(dtype), NaN payloads included
    for pd in (torch.float16, torch.bfloat16):
        masters = [special_values(n, torch.float32, gen) for n in SIZES]
        params = [torch.zeros(n, dtype=pd) for n in SIZES]
        zeros = [[torch.zeros(n) for n in SIZES] for _ in range(3)]
        cpu.adamw_update_(Batch(params, zeros[0], zeros[1], zeros[2], [None] * len(SIZES), [torch.zeros(()) for _ in SIZES],
                                masters, [0] * len(SIZES), [Hyper(0.0, 0.9, 0.999, 1e-8, 0.0, False, False)]),
                          torch.tensor([0.0, 0.0, 1.0, 0.0]))
        out[f"write-back-{pd}"] = (masters, params)
    compact_steps(out, gen)
    torch.save(out, OUT)


COMPACT_MODES = (("split16", torch.bfloat16), ("split8", "int8"), (False, torch.bfloat16), ("fp32", "int8"),
                 ("split16", "int4"), (False, "int4"))
# blockwise moments take 2-D params (1-D ones keep fp32 moments): rows that end in a short block, and
# whole blocks; int4 rows are even
SHAPES = {"int8": ((5, 1031), (3, 2048)), "int4": ((5, 1030), (3, 2048))}


def compact_steps(out, gen):
    """Three steps of the optimizer in each compact mode (with AMSGrad once), clipped: params and state."""
    for master_weights, state_dtype in COMPACT_MODES:
        for amsgrad in (False, True):
            shapes = SHAPES.get(state_dtype, (4099, 8192 + 7))
            params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.05).bfloat16()) for n in shapes]
            opt = ampfused.FusedAmpAdamW(params, lr=1e-2, amsgrad=amsgrad, max_grad_norm=1.0, backend="cpu",
                                         master_weights=master_weights, state_dtype=state_dtype)
            for _ in range(3):
                for p in params:
                    p.grad = (torch.randn(p.shape, generator=gen) * 0.1).bfloat16()
                opt.step()
            state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
            out[f"upd-compact-{master_weights}-{state_dtype}-{amsgrad}"] = [p.detach() for p in params] + state


main()
