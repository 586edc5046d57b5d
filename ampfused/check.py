"""`python -m ampfused check`: every backend available here, the reference included, against an oracle outside them all.

For each backend that can serve tensors here (``ampfused._backends``: on a GPU cuda, triton and
reference on CUDA tensors and cpu on CPU tensors; on a CPU cpu, reference, and triton under
``TRITON_INTERPRET=1``), each case below drives a ``FusedAmpAdamW`` (and an ``ampfused.GradScaler``
where the case has one) through a few steps of a synthetic problem (a linear loss, so every run sees
the same gradients) and holds it to the oracle stepping the same problem. It prints a table
(backend x case: pass/fail, worst error as a fraction of what the rule allows, time) and returns
non-zero on any failure; each failure names the case, the step, the tensor or state key and the
first element that breaks the rule, with the value got and expected.

The oracle (``ampfused.check_oracle``) runs no backend: ``torch.optim.AdamW``, ``torch.amp.GradScaler``
and ``clip_grad_norm_`` on fp32 copies of the params (the fp32-master recipe) wherever torch defines
the result, the executable specification ``ampfused._compact.compact_adamw_step_`` for the compact
states torch has no form for. No row compares a backend with itself. The oracle steps alone on the
row's device and is snapshotted after every step; before step k the run under test is loaded with
the oracle's params and state after step k-1. Every comparison is then one step from the same bits,
so the per-step rules of the kernel tests apply and errors never compound.

Rules (the test suite's; ``tests/helpers.py`` takes its tolerances from here):

- bitwise: step counters, the loss scale, its growth tracker and the skip count, ``p.grad`` after
  the step (the unscaled ``g * fp32(1/S)`` after a scaled step, untouched otherwise), and
  everything (params, masters, moments, codes, scales, grads) across a skipped step; a 16-bit
  param with a master is the round-to-nearest-even of its (decoded) master;
- fp32 values (fp32 params, masters, moments, int8 block scales, ``grad_norm``): ``TOLERANCES``;
- a 16-bit param (the rounding of its master) and bf16 moments: one bf16 ulp (2^-7 relative);
- int8/uint8 moment codes and int4 codes (unpacked, one per element): one grid step; a split8 master
  (decoded): 2^-14 relative (its unit).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import _backends, _compact, _gpu_advice, check_oracle
from ._contract import moment_encoding
from .optim import FusedAmpAdamW
from .scaler import GradScaler

# The reference backend follows torch's single-tensor AdamW operation by operation (DESIGN §2.6: within
# 1e-6 relative of torch.optim.AdamW); kernel backends fuse the same math in another order, so they get
# wider fp32-rounding tolerances.
TOLERANCES = {"reference": dict(rtol=1e-6, atol=1e-7)}
KERNEL_TOLERANCE = dict(rtol=2e-5, atol=2e-6)
ONE_BF16_ULP_PARAM = dict(rtol=2**-7, atol=1e-5)  # a 16-bit param: the rounding of a master that may differ in an ulp
ONE_BF16_ULP = dict(rtol=2**-7, atol=0.0)  # bf16 moments
SPLIT8_MASTER = dict(rtol=2**-14, atol=1e-7)  # an ulp of the fp32 math moves a residual by its unit, ulp(p)/256


def tolerance(backend: str) -> dict:
    """The fp32 tolerance a backend is held to against the oracle."""
    return TOLERANCES.get(backend, KERNEL_TOLERANCE)


# ------------------------------------------------------------------ the cases

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# ragged sizes: none a multiple of a vector width, a Triton block or an int8 block
MIXED = (((33, 31), F32), ((1025,), BF16), ((300,), F16), ((7,), BF16))
AMP_SCALER = dict(init_scale=3000.0, growth_interval=2)  # not a power of two: unscaling rounds


@dataclass(frozen=True)
class Case:
    name: str
    params: tuple  # ((shape, dtype), ...)
    options: dict = field(default_factory=dict)  # FusedAmpAdamW keyword arguments
    steps: int = 2
    scaler: dict | None = None  # ampfused.GradScaler keyword arguments
    bad_step: int | None = None  # an inf in one gradient element at this step: the step is skipped
    micro_batches: int = 1
    tensor_lr: bool = False  # lr as a tensor, scaled in place after each step as a scheduler would
    graph: bool = False  # static grads; steps after the first replay one captured CUDA graph (GRAPH_BACKENDS on CUDA)


CASES = (
    Case("fp32", (((33, 31), F32), ((1025,), F32), ((7,), F32))),
    Case("amsgrad-maximize", MIXED, dict(amsgrad=True, maximize=True, weight_decay=0.1)),
    Case("tensor-lr", (((33, 31), F32), ((1025,), BF16)), dict(lr=4e-3), steps=3, tensor_lr=True),
    Case("fp16-bf16-scaler-clip", MIXED, dict(max_grad_norm=1.0), steps=4, scaler=AMP_SCALER, bad_step=1,
         micro_batches=2),
    Case("master-no-fp32-accumulation", MIXED, dict(fp32_grad_accumulation=False, max_grad_norm=1.0), steps=3,
         bad_step=1),
    Case("no-master", MIXED, dict(master_weights=False)),
    Case("no-master-fp32-accumulation", MIXED, dict(master_weights=False, fp32_grad_accumulation=True), steps=3,
         scaler=AMP_SCALER, bad_step=1, micro_batches=2),
    Case("split16", (((1025,), BF16), ((300,), BF16), ((33, 31), F32)),
         dict(master_weights="split16", amsgrad=True, max_grad_norm=1.0), steps=3, scaler=AMP_SCALER, bad_step=1),
    Case("split8-bf16-moments", (((1025,), BF16), ((300,), F16), ((7,), BF16)),
         dict(master_weights="split8", state_dtype=BF16)),
    Case("no-master-bf16-moments-sr", (((1025,), BF16), ((300,), BF16), ((33, 31), F32)),
         dict(master_weights=False, state_dtype=BF16, stochastic_rounding=True)),
    # one 2-d tensor past SMALL_TENSOR_NUMEL (int8 codes; rows of 300, so blocks are cut by the row and
    # the tensor's end), one small (stays fp32)
    Case("int8-moments", (((_compact.SMALL_TENSOR_NUMEL // 300 + 3, 300), BF16), ((7,), BF16)),
         dict(state_dtype="int8", amsgrad=True)),
    # the same with int4 codes (rows of 300: an even last dimension, two codes per byte) and a split16 master
    Case("int4-moments", (((_compact.SMALL_TENSOR_NUMEL // 300 + 3, 300), BF16), ((7,), BF16)),
         dict(state_dtype="int4", master_weights="split16", amsgrad=True)),
    Case("cuda-graph", MIXED, dict(fp32_grad_accumulation=False, amsgrad=True, max_grad_norm=0.5), steps=4,
         bad_step=2, graph=True),
)

GRAPH_BACKENDS = ("cuda", "triton")  # those the test suite captures (tests/contract/test_gpu.py); reference is eager


def applies(case: Case, backend: str, device: torch.device) -> bool:
    return not case.graph or (device.type == "cuda" and backend in GRAPH_BACKENDS)


def targets(case: Case, step: int, micro: int) -> list[Tensor]:
    """The fp32 tensors ``G`` of the loss ``sum(p * G)``: the gradient of every param at this micro-batch."""
    gen = torch.Generator().manual_seed(1000 + 10 * step + micro)
    out = [torch.randn(shape, generator=gen) * 0.1 for shape, _ in case.params]
    if step == case.bad_step and micro == 0:
        out[0].view(-1)[3] = math.inf
    return out


@contextmanager
def _serving(backend: str):
    """The scaler's update pass follows AMPFUSED_BACKEND: the row's backend serves it too."""
    before = os.environ.get(_backends.ENV_VAR)
    os.environ[_backends.ENV_VAR] = backend
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a table, not the fallback notes of every case
            yield
    finally:
        if before is None:
            del os.environ[_backends.ENV_VAR]
        else:
            os.environ[_backends.ENV_VAR] = before


def initial_params(case: Case, device: torch.device) -> list[Tensor]:
    """The params every run of ``case`` (and its oracle) starts from."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(shape, generator=gen) * 0.5).to(device=device, dtype=dtype) for shape, dtype in case.params]


class Run:
    """One optimizer (and scaler) over a case's params on one backend and device."""

    def __init__(self, case: Case, backend: str, device: torch.device):
        self.case, self.backend, self.device = case, backend, device
        self.params = [torch.nn.Parameter(p) for p in initial_params(case, device)]
        options = dict(case.options)
        if case.tensor_lr:
            options["lr"] = torch.tensor(options.get("lr", 1e-3), device=device)
        with _serving(backend):
            self.opt = FusedAmpAdamW(self.params, backend=backend, **options)
        self.scaler = GradScaler(device.type, **case.scaler) if case.scaler else None
        self.static = None  # the graph case's gradients, written in place
        self.capture = case.graph and applies(case, backend, device)  # the oracle steps the same grads eagerly
        self.graph = None

    def step(self, k: int) -> None:
        with _serving(self.backend):
            self._step(k)

    def _step(self, k: int) -> None:
        case, opt = self.case, self.opt
        if case.graph:  # the same grad tensors at every step, as a captured graph reads them
            if self.static is None:
                self.static = [torch.zeros_like(p) for p in self.params]
                for p, s in zip(self.params, self.static):
                    p.grad = s
            for s, t in zip(self.static, targets(case, k, 0)):
                s.copy_(t)
        else:
            opt.zero_grad()
            for micro in range(case.micro_batches):
                loss = sum((p.float() * t.to(self.device)).sum() for p, t in zip(self.params, targets(case, k, micro)))
                (self.scaler.scale(loss) if self.scaler else loss).backward()
        torch.manual_seed(k)  # the stochastic-rounding seed, drawn from torch's CPU generator in step()
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        elif not self.capture:
            opt.step()
        elif k == 0:  # warm up on a side stream (lazy state, tables, compilation), as torch's docs ask
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                opt.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    opt.step()
            self.graph.replay()
        if case.tensor_lr:
            opt.param_groups[0]["lr"].mul_(0.9)

    def snapshot(self) -> dict:
        """Copies of everything compared: (what, param index or None) -> tensor."""
        snap = {}
        for i, p in enumerate(self.params):
            snap[("param", i)] = p.detach().clone()
            if p.grad is not None:
                snap[("grad", i)] = p.grad.detach().clone()
            for key, value in self.opt.state[p].items():
                snap[(key, i)] = value.detach().clone()
        if self.opt.grad_norm is not None:
            snap[("grad_norm", None)] = self.opt.grad_norm.detach().clone()
        if self.scaler is not None:
            sd = self.scaler.state_dict()
            for key in ("scale", "_growth_tracker", "skipped_steps"):
                snap[(key, None)] = torch.tensor(float(sd[key]), dtype=torch.float64)
        return snap

    @torch.no_grad()
    def load(self, snap: dict) -> None:
        """Params and optimizer state from an oracle snapshot, in place (a captured graph keeps its addresses)."""
        for (key, i), value in snap.items():
            if key == "param":
                self.params[i].copy_(value)
            elif i is not None and key != "grad":
                self.opt.state[self.params[i]][key].copy_(value)


# ------------------------------------------------------------------ the rules

def rule_of(key: str, tensor: Tensor, backend: str, skipped: bool):
    """(kind, allowance) for one compared entry: ("bits", None), ("close", tol) or ("codes", steps)."""
    if skipped or key in ("step", "grad", "scale", "_growth_tracker", "skipped_steps"):
        return "bits", None
    if key.endswith("_codes"):
        return "codes", 1
    if key == "master_residual8":
        return "close", SPLIT8_MASTER
    if tensor.dtype in (F16, BF16):
        return "close", ONE_BF16_ULP_PARAM if key == "param" else ONE_BF16_ULP
    return "close", tolerance(backend)


def compared(snap: dict) -> dict:
    """The snapshot as compared: split masters decoded to fp32 (key kept), int4 codes unpacked (a grid
    step is one in either nibble), fp32 grad_norm as is."""
    out = {}
    for (key, i), value in snap.items():
        if key.endswith("_codes") and moment_encoding(snap[("exp_avg_codes", i)]) == "int4":
            value = _compact.unpack4(value.cpu())
        elif key == "master_low16":
            value = _compact.join16(snap[("param", i)].cpu(), value.cpu())
        elif key == "master_residual8":
            value = _compact.join8(snap[("param", i)].cpu(), value.cpu())
        out[(key, i)] = value.cpu()
    return out


def _bits(t: Tensor) -> Tensor:
    if t.is_floating_point():
        return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def violation(got: Tensor, want: Tensor, kind: str, allowance) -> tuple[float, int | None]:
    """(worst error as a fraction of the allowance, flat index of the first element that breaks it or None)."""
    if kind == "bits":
        g, w = got.reshape(-1), want.reshape(-1)
        nan = torch.isnan(w) & torch.isnan(g) if w.is_floating_point() else torch.zeros_like(w, dtype=torch.bool)
        bad = (_bits(g) != _bits(w)) & ~nan
        err = bad.double()
    elif kind == "codes":
        err = (got.reshape(-1).long() - want.reshape(-1).long()).abs().double() / allowance
        bad = err > 1
    else:
        g, w = got.reshape(-1).double(), want.reshape(-1).double()
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
        allowed = allowance["atol"] + allowance["rtol"] * w.abs()
        err = torch.where(same, 0.0, (g - w).abs() / allowed)
        err = torch.where(torch.isnan(err), math.inf, err)  # a NaN or an inf on one side only
        bad = err > 1
    worst = float(err.max()) if err.numel() else 0.0
    first = bad.nonzero()
    return (math.inf if kind == "bits" and first.numel() else worst), (int(first[0]) if first.numel() else None)


def _index(flat: int, shape) -> tuple:
    return tuple(int(x) for x in torch.unravel_index(torch.tensor(flat), shape))


def _name(key: str, i) -> str:
    if i is None:
        return "grad_norm" if key == "grad_norm" else f"scaler {key.lstrip('_')}"
    return f"param {i}" if key == "param" else f"param {i} grad" if key == "grad" else f"param {i} state {key!r}"


def _describe(kind: str, allowance) -> str:
    if kind == "bits":
        return "bitwise"
    if kind == "codes":
        return f"within {allowance} code"
    return f"rtol {allowance['rtol']:.3g}, atol {allowance['atol']:.3g}"


def compare(got: dict, want: dict, backend: str, skipped: bool) -> tuple[float, list[str]]:
    """(worst error fraction, failure messages) of a run's snapshot against the oracle's after one step."""
    if got.keys() != want.keys():
        missing = sorted(map(str, want.keys() - got.keys()))
        extra = sorted(map(str, got.keys() - want.keys()))
        return math.inf, [f"compared entries differ: missing {missing}, unexpected {extra}"]
    worst, failures = 0.0, []
    got, want = compared(got), compared(want)
    for (key, i), w in want.items():
        g = got[(key, i)]
        name = _name(key, i)
        if key == "grad_norm" and skipped:  # non-finite on a skipped step, whatever the value
            if bool(torch.isfinite(g)):
                failures.append(f"{name}: got {g.item()!r} on a skipped step, expected a non-finite value")
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            failures.append(f"{name}: got {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}")
            continue
        kind, allowance = rule_of(key, w, backend, skipped and key != "grad_norm")
        err, first = violation(g, w, kind, allowance)
        worst = max(worst, err)
        if first is not None:
            at = f" at index {_index(first, w.shape)}" if w.dim() else ""
            got_v, want_v = g.reshape(-1)[first].item(), w.reshape(-1)[first].item()
            how = _describe(kind, allowance) + (" across a skipped step" if skipped else "")
            if kind != "bits":
                how += f"; worst element {err:.3g} x allowed"
            failures.append(f"{name}{at}: got {got_v!r}, expected {want_v!r} ({how})")
    return worst, failures + rounding_failures(got)


def rounding_failures(snap: dict) -> list[str]:
    """A 16-bit param with a master is the round-to-nearest-even of that master, bitwise (DESIGN §2.5, §9)."""
    failures = []
    for (key, i), master in snap.items():
        if key in ("master_param", "master_low16", "master_residual8"):
            param = snap[("param", i)]
            want = master.to(param.dtype)
            _, first = violation(param, want, "bits", None)
            if first is not None:
                failures.append(f"param {i} at index {_index(first, param.shape)}: got {param.reshape(-1)[first].item()!r}, expected "
                                f"{want.reshape(-1)[first].item()!r}, the rounding of its master {key!r} (bitwise)")
    return failures


# ------------------------------------------------------------------ running

def oracle_trajectory(case: Case, device: torch.device) -> list[dict]:
    """The oracle's snapshot after each step of ``case`` on ``device`` (``ampfused.check_oracle``: no backend runs)."""
    return check_oracle.trajectory(case, initial_params(case, device), lambda step, micro: targets(case, step, micro))


def check_case(case: Case, backend: str, device: torch.device, oracle: list[dict]) -> tuple[float, list[str]]:
    """(worst error fraction, failures) of ``backend`` on ``case``, stepped in lockstep with ``oracle``."""
    run = Run(case, backend, device)
    worst = 0.0
    for k in range(case.steps):
        if k:
            run.load(oracle[k - 1])
        run.step(k)
        err, failures = compare(run.snapshot(), oracle[k], backend, skipped=k == case.bad_step)
        worst = max(worst, err)
        if failures:
            return worst, [f"step {k}: {f}" for f in failures]
    return worst, []


def rows(names: list[str] | None, device: str | None) -> tuple[list[tuple[str, torch.device]], list[tuple[str, str]]]:
    """(backend, device) pairs to check, and (backend, why not) for those that cannot serve here.

    Each backend runs on the first of (cuda, cpu) it serves (``--device`` fixes one)."""
    cuda = torch.cuda.is_available()
    devices = [device] if device else (["cuda"] if cuda else []) + ["cpu"]
    found, missing = [], []
    for name in names or _backends.BACKEND_NAMES:
        reasons = []
        for dev in map(torch.device, devices):
            try:
                _backends.resolve(name, dev)
            except RuntimeError as exc:
                reasons.append(str(exc))
                continue
            found.append((name, dev))
            break
        else:
            missing.append((name, "; ".join(reasons)))
    return found, missing


def run_check(names: list[str] | None = None, device: str | None = None, out=None) -> int:
    """Check the backends, print the table to ``out`` (stdout); 0 when everything passed, else 1."""
    out = out or sys.stdout
    if device == "cuda" and not torch.cuda.is_available():
        print("ampfused check: --device cuda, but CUDA is not available to torch on this machine", file=out)
        return 1
    found, missing = rows(names, device)
    start = time.perf_counter()
    oracles: dict = {}
    failures, results = [], []
    head = f"{'backend':<10} {'device':<6} {'case':<30} {'result':<6} {'err/tol':>8} {'time':>7}"
    print(f"ampfused check: torch {torch.__version__}; each backend against torch.optim.AdamW (fp32 masters for 16-bit "
          "params) or, for compact state, the executable spec, step by step; "
          "err/tol: worst error as a fraction of what its rule allows (0: bitwise)", file=out)
    print(head + "\n" + "-" * len(head), file=out, flush=True)
    # the steps seed torch's generators (stochastic rounding): the caller's states come back afterwards
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        for name, dev in found:
            for case in CASES:
                if not applies(case, name, dev):
                    continue
                key = (case.name, dev)
                t0 = time.perf_counter()
                try:
                    if key not in oracles:
                        oracles[key] = oracle_trajectory(case, dev)
                        t0 = time.perf_counter()
                    worst, bad = check_case(case, name, dev, oracles[key])
                except Exception as exc:  # a crash is a failure of this row, not of the check
                    worst, bad = math.inf, [f"raised {type(exc).__name__}: {exc}"]
                seconds = time.perf_counter() - t0
                results.append(not bad)
                failures += [f"FAILED {name}/{case.name}: {line}" for line in bad[:5]]
                print(f"{name:<10} {dev.type:<6} {case.name:<30} {'pass' if not bad else 'FAIL':<6} {worst:>8.3g} "
                      f"{seconds:>6.2f}s", file=out, flush=True)
    no_gpu = not _gpu_advice.machine_has_gpu()
    for name, why in missing:
        if no_gpu and name in _gpu_advice.GPU_BACKENDS:  # nothing is broken: say what the backend needs
            why = _gpu_advice.no_gpu_reason(name)
        line = f"{name}: not checked: {why}"
        if names:  # asked for by name: its absence is a failure
            failures.append(f"FAILED {line}")
        else:
            print(line, file=out)
    if no_gpu and {name for name, _ in missing} & set(_gpu_advice.GPU_BACKENDS):
        print(_gpu_advice.no_gpu_note(), file=out)
    for line in failures:
        print(line, file=out)
    total = time.perf_counter() - start
    passed = sum(results)
    if failures:
        print(f"ampfused check: {len(results) - passed} of {len(results)} failed"
              f"{f', {len(missing)} backend(s) asked for but unavailable' if names and missing else ''} ({total:.1f} s)",
              file=out)
        return 1
    if not results:
        print("ampfused check: no backend could run here", file=out)
        return 1
    print(f"ampfused check: all {len(results)} passed ({len(found)} backends, {total:.1f} s)", file=out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ampfused check",
        description="Run every backend available on this machine, the reference included, against "
                    "torch.optim.AdamW (and the executable spec for compact state) on small "
                    "synthetic problems; exit status 1 on any failure. Triton serves CPU tensors only with "
                    "TRITON_INTERPRET=1 set in the environment.")
    parser.add_argument("--backend", action="append", choices=_backends.BACKEND_NAMES, metavar="NAME",
                        help=f"check only this backend (repeatable; one of {', '.join(_backends.BACKEND_NAMES)})")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="run every backend on this device (default: CUDA where a backend serves it, else the CPU)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_check(list(dict.fromkeys(args.backend)) if args.backend else None, args.device)
