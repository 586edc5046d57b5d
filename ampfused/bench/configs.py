"""What the optimizer-step benchmark measures: a *case* is one parameter set (a :class:`ShapeSet`)
under one :class:`StepConfig`, and every provider is timed on every case of the chosen sweeps (the
configurations, sweeps and plans: benchmarks/README.md §1)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = {"fp32": torch.float32, **LOW_PRECISION}

# Hyperparameters shared by every provider (the correctness gate compares them step for step).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
MAX_GRAD_NORM = 1.0
INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 10**9  # beyond any step count timed: the scale (what the scaled grads mean) stays put
GRAD_STD = 1e-3  # unscaled gradient magnitude: the global norm is >> MAX_GRAD_NORM at every size, so clipping engages


@dataclass(frozen=True)
class StepConfig:
    """The training-step tail being benchmarked. fp32 params take one micro-batch (autograd accumulates
    fp32 grads itself); ``fresh_grads``: new grad tensors every step (providers.FreshGrads)."""

    param_dtype: str
    micro_batches: int
    loss_scaling: bool
    clip: bool
    fresh_grads: bool = False

    @property
    def name(self) -> str:
        parts = [self.param_dtype, self.low_precision and f"x{self.micro_batches}", self.loss_scaling and "scaled",
                 "clip" if self.clip else "noclip", self.fresh_grads and "fresh-grads"]
        return "-".join(p for p in parts if p)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype]

    @property
    def low_precision(self) -> bool:
        return self.param_dtype in LOW_PRECISION


FP32_CLIP = StepConfig("fp32", 1, True, True)
FP32_NOCLIP = StepConfig("fp32", 1, True, False)
FP32_CLIP_FRESH = StepConfig("fp32", 1, True, True, fresh_grads=True)
BF16_X1_CLIP = StepConfig("bf16", 1, False, True)
BF16_X4_CLIP = StepConfig("bf16", 4, False, True)
FP16_X1_CLIP = StepConfig("fp16", 1, True, True)

# ---------------------------------------------------------------- shapes

# GPT-2 124M (n_layer=12, d=768, vocab 50257, context 1024, tied head): 148 tensors.
_GPT2_BLOCK = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
GPT2_124M = [(50257, 768), (1024, 768)] + _GPT2_BLOCK * 12 + [(768,), (768,)]
# Llama-2-7B (32 layers, d=4096, ffn 11008, vocab 32000, untied head): 291 tensors.
_LLAMA_BLOCK = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008), (4096,), (4096,)]
LLAMA_7B = [(32000, 4096)] + _LLAMA_BLOCK * 32 + [(4096,), (32000, 4096)]


@dataclass(frozen=True)
class ShapeSet:
    """The tensor shapes of one ``family`` ("few-large", "gpt2-like", "llama-like", "tiny")."""

    family: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def count(self) -> int:
        return len(self.shapes)

    @property
    def label(self) -> str:
        return f"{self.family} {human(self.numel)} ({self.count} tensors)"


def shape_set(family: str, total: int) -> ShapeSet:
    """``total`` params as 4 equal one-row tensors, or as the real model's tensors with their rows scaled
    (their row lengths decide int8 moments' blocks, [note: blocks in rows])."""
    if family == "few-large":
        base = [total // 4] * 4
        base[0] += total - sum(base)
        return ShapeSet(family, tuple((1, n) for n in base))
    model = {"gpt2-like": GPT2_124M, "llama-like": LLAMA_7B}[family]
    scale = total / sum(math.prod(s) for s in model)
    return ShapeSet(family, tuple((max(1, round(s[0] * scale)), *s[1:]) for s in model))


def human(n: float) -> str:
    unit, div = next(((u, d) for u, d in (("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= d), ("", 1))
    value = n / div
    return f"{value:.0f}{unit}" if value >= 10 or value == int(value) else f"{value:.1f}{unit}"


# ---------------------------------------------------------------- sweeps


@dataclass(frozen=True)
class Case:
    sweeps: tuple[str, ...]  # the sweeps (SWEEPS) this measurement belongs to
    shapes: ShapeSet
    config: StepConfig

    @property
    def label(self) -> str:
        return f"{self.config.name} on {self.shapes.label}"

    @property
    def host(self) -> bool:
        """Timed on the host (HOST_COUNTS), not on the device."""
        return self.sweeps == ("host",)


SWEEPS = ("configs", "size", "tensors", "host", "memory")
# DESIGN §9's compact state, the memory sweep's rows on bf16 params: name -> FusedAmpAdamW keyword arguments.
# The int4 rows with a master read autograd's bf16 gradients: the smallest layouts, 5, 6 and 7 B/param. No row
# rounds stochastically: the gate holds a row to the reference within fp32 tolerances.
MEMORY_MODES = {
    "split16": dict(master_weights="split16"), "split8": dict(master_weights="split8"),
    "bf16-moments": dict(state_dtype=torch.bfloat16), "int8-moments": dict(state_dtype="int8"),
    "split16+bf16": dict(master_weights="split16", state_dtype=torch.bfloat16),
    "split8+int8": dict(master_weights="split8", state_dtype="int8"),
    "int4-moments": dict(state_dtype="int4"),
    "split16+int4+bf16-grads": dict(master_weights="split16", state_dtype="int4", fp32_grad_accumulation=False),
    "split8+int4+bf16-grads": dict(master_weights="split8", state_dtype="int4", fp32_grad_accumulation=False),
    "no-master+int4": dict(master_weights=False, state_dtype="int4"),
}
# The host sweep: tiny tensors, so a step's time is the host's Python and dispatch work; the tensor
# counts of GPT-2 124M, Llama-2-7B and a model with 2000 params
HOST_COUNTS, HOST_NUMEL = (148, 291, 2000), 16

# Every configuration at one size, the other axes for fewer: the default CPU run covers every axis
# in about two minutes.
PLANS = {
    # name: (configs-sweep total, size-sweep totals, tensors-sweep total)
    "quick": (256_000, (1_000_000,), 256_000),
    "cpu": (4_000_000, (1_000_000, 4_000_000, 16_000_000, 50_000_000), 4_000_000),
    "gpu": (124_000_000, (1_000_000, 10_000_000, 100_000_000, 1_000_000_000), 124_000_000),
}


def plan(name: str, sweeps: tuple[str, ...] = SWEEPS, sizes: tuple[int, ...] | None = None) -> list[Case]:
    """The cases of plan ``name`` ("quick", "cpu", "gpu"), deduplicated, in run order."""
    configs_total, size_totals, tensors_total = PLANS[name]
    size_totals, cases = sizes or size_totals, []
    if "configs" in sweeps:  # fp32 (autocast AMP with a scaler); bf16 and fp16 params with N in {1, 4}; +-clip
        configs = [FP32_CLIP, BF16_X4_CLIP, FP16_X1_CLIP] if name == "quick" else [
            c for clip in (True, False) for c in [StepConfig("fp32", 1, True, clip)] + [
                StepConfig(dtype, n, scaled, clip) for dtype, scaled in (("bf16", False), ("fp16", True)) for n in (1, 4)]]
        cases += [("configs", shape_set("gpt2-like", configs_total), c) for c in configs]
    if "size" in sweeps:
        head = (FP32_CLIP, BF16_X1_CLIP) if name == "gpu" else (FP32_CLIP,)
        cases += [("size", shape_set("few-large", total), c) for c in head for total in size_totals]
    if "tensors" in sweeps:
        head = (FP32_CLIP, BF16_X4_CLIP) if name != "quick" else (FP32_CLIP,)
        cases += [("tensors", shape_set(f, tensors_total), c) for c in head for f in ("few-large", "gpt2-like", "llama-like")]
    if "host" in sweeps:
        counts = HOST_COUNTS if name != "quick" else HOST_COUNTS[:1]
        cases += [("host", ShapeSet("tiny", ((HOST_NUMEL,),) * n), c) for c in (FP32_CLIP, FP32_NOCLIP, FP32_CLIP_FRESH)
                  for n in counts]
    if "memory" in sweeps:  # (quick: a few tensors big enough for int8 moments; the fallback is slow)
        if name == "quick":
            cases.append(("memory", shape_set("few-large", 65_536), BF16_X1_CLIP))
        else:
            cases.append(("memory", shape_set("gpt2-like", configs_total), BF16_X1_CLIP))
            if name == "gpu" or sizes:  # on a CPU the largest size only when asked (--sizes 50M): the
                # modes a backend lacks run through the reference passes, minutes per row at 50M
                cases.append(("memory", shape_set("few-large", max(size_totals)), BF16_X1_CLIP))
    merged: dict[tuple, tuple[str, ...]] = {}  # a case shared by two sweeps is measured once
    for sweep, shapes, config in cases:
        merged[(shapes, config)] = merged.get((shapes, config), ()) + (sweep,)
    return [Case(sweeps, shapes, config) for (shapes, config), sweeps in merged.items()]
