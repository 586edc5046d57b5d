"""The memory modes of DESIGN §9 as variants of the end-to-end training benchmark (``bench_train.py``).

Each mode trains the low-precision-params model (``ampfused-<bf16|fp16>-params``) with
``FusedAmpAdamW`` in that mode and is held, like every mixed-precision variant, to the fp32 run's
held-out loss. What each variant keeps between steps is measured from its tensors (:func:`kept_bytes`).

[note: split16 lockstep twin] ``"split16"`` is exact, so it is held to more than a tolerance: its
optimizer steps in lockstep with a twin ``FusedAmpAdamW`` on fp32 masters that gets the same fp32
gradients (copied in before each step; only the optimizer runs twice, the model once). After every
step the params, ``exp_avg``, ``exp_avg_sq`` and step count must be bitwise equal, and the masters
too except at exact ties (the fp32 master's low half is ``0x8000``), where ``_compact``'s tie rule
moves the stored master by exactly one fp32 ulp. The twin then takes split16's master, so every
step is checked from the same state. Why not compare with the ``ampfused-bf16-params`` run
itself: ties are not rare -- about 2^-16 of the elements per step, a few per step on the CPU
preset's 0.12M params -- and a moved master parts from the other run's by a growing number of
ulps until a param rounds the other way (after a few dozen steps there), after which the two
runs differ everywhere, by rounding noise. The free-running split16 row is still reported and
gated against fp32 like the other modes.
"""
from __future__ import annotations

import torch
from torch import Tensor

import ampfused
from ampfused import _compact

from ampfused.bench import measure
from ampfused.bench.configs import MEMORY_MODES

# name -> FusedAmpAdamW keyword arguments. Every mode keeps the default gradient accumulation (fp32 p.main_grad
# with a master, autograd's bf16 p.grad without), so that two modes with a master differ in their state alone.
MODES = {
    **{name: dict(MEMORY_MODES[name]) for name in ("split16", "split8", "bf16-moments", "int8-moments", "split8+int8")},
    "no-master+sr": dict(master_weights=False, stochastic_rounding=True),  # bf16 params rounded stochastically
    "int4-moments": dict(state_dtype="int4"),
    "split16+int4": dict(master_weights="split16", state_dtype="int4"),
    "split8+int4": dict(master_weights="split8", state_dtype="int4"),
    "no-master+sr+int4": dict(master_weights=False, stochastic_rounding=True, state_dtype="int4"),
}
# split16 has no fp16 form; stochastic rounding rounds bf16 writes
BF16_ONLY = tuple(m for m in MODES if MODES[m].get("master_weights") == "split16" or MODES[m].get("stochastic_rounding"))
SEP = "@"  # variant-name separator, as the step benchmark's provider names: "ampfused-bf16-params@split8"


def modes_for(lowp: str) -> list[str]:
    return [m for m in MODES if lowp == "bf16" or m not in BF16_ONLY]


def mode_of(variant: str) -> str | None:
    return variant.partition(SEP)[2] or None


def kept_bytes(params: list[Tensor], opt, master=None) -> int:
    """Bytes kept between steps, measured from the tensors after the last backward of a step (the
    gradients alive): the params, their gradients and the optimizer's state. ampfused:
    ``opt.state_bytes()`` (which counts its fp32 gradient storage) plus autograd's gradients where
    the optimizer reads them directly; torch: every state tensor, and the hand-written recipe's fp32
    masters with their gradients (``master``)."""
    if isinstance(opt, ampfused.FusedAmpAdamW):
        grads = [p.grad for p in params if p.grad is not None and getattr(p, "main_grad", None) is None]
        return measure.storage_bytes([*params, *grads]) + opt.state_bytes()
    tensors = [*params, *(p.grad for p in params if p.grad is not None)]
    if master is not None:
        tensors += [*master.masters, *(m.grad for m in master.masters)]
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
    return measure.storage_bytes(tensors)


def coded_elements(params: list[Tensor], opt) -> int:
    """Elements whose moments are int8 or int4 codes (tensors under ``_compact.SMALL_TENSOR_NUMEL`` keep fp32 moments)."""
    return sum(p.numel() for p in params if "exp_avg_codes" in opt.state.get(p, {}))


class Split16Twin:
    """See [note: split16 lockstep twin]: an fp32-master optimizer stepping beside a split16 one."""

    def __init__(self, params: list[Tensor], **opt_kwargs):
        self.params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        self.opt = ampfused.FusedAmpAdamW(self.params, master_weights="fp32", **opt_kwargs)
        self.ties = 0  # elements where split16's master is the fp32 one moved by its tie rule, summed over steps
        self.steps = 0  # steps checked
        self.problem = ""  # the first difference the tie rule does not explain ("" while identical)

    def step(self, params: list[Tensor]) -> None:
        """One step of the twin on the fp32 gradients the split16 run holds now (before its own step)."""
        if self.problem:
            return
        for twin, p in zip(self.params, params):
            twin.main_grad.copy_(p.grad)
            twin.grad = twin.main_grad
        self.opt.step()
        self.opt.zero_grad()

    def check(self, params: list[Tensor], opt, step: int) -> None:
        """Compare with the split16 run after its step, then give the twin split16's master."""
        if self.problem:
            return
        self.steps += 1
        for i, (twin, p) in enumerate(zip(self.params, params)):
            mine, theirs = self.opt.state[twin], opt.state[p]
            for what, a, b in (("param", twin, p), ("exp_avg", mine["exp_avg"], theirs["exp_avg"]),
                               ("exp_avg_sq", mine["exp_avg_sq"], theirs["exp_avg_sq"]),
                               ("step", mine["step"], theirs["step"])):
                if not torch.equal(a.detach().view(-1).view(_int(a)), b.detach().view(-1).view(_int(b))):
                    self.problem = f"step {step}, param {i}: {what} differs from the fp32-master twin's"
                    return
            fp32 = mine["master_param"]
            split = _compact.join16(p.detach(), theirs[_compact.MASTER_KEYS["split16"]])
            want, got = fp32.view(torch.int32).long(), split.view(torch.int32).long()
            tie = (want & 0xFFFF) == 0x8000
            differ = want != got
            if not torch.equal(differ, tie) or bool(((want - got).abs() > 1).any()):
                where = int((differ != tie).nonzero()[0]) if not torch.equal(differ, tie) else -1
                self.problem = (f"step {step}, param {i}: master differs from the fp32 master "
                                + (f"off a tie (element {where})" if where >= 0 else "by more than 1 ulp at a tie"))
                return
            self.ties += int(tie.sum())
            fp32.copy_(split)

    def verdict(self) -> str:
        if self.problem:
            return f"NOT identical to fp32 masters: {self.problem}"
        return (f"identical to an fp32-master twin at all {self.steps} steps (params, exp_avg, exp_avg_sq bitwise; "
                f"masters bitwise but at {self.ties} ties, each 1 fp32 ulp by the tie rule)")


def _int(t: Tensor) -> torch.dtype:
    """The integer dtype of ``t``'s width (bitwise comparison: -0.0 != 0.0, NaN == the same NaN)."""
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
