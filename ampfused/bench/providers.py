"""The implementations compared, each timing one training-step tail (from the end of the last
``backward()`` to the next forward) behind ``step()``, and their bytes model (benchmarks/README.md §1)."""
from __future__ import annotations

import torch
from torch import Tensor

import ampfused
from ampfused import _compact

from . import measure
from .configs import BETAS, EPS, GRAD_STD, GROWTH_INTERVAL, INIT_SCALE, LR, MAX_GRAD_NORM, MEMORY_MODES, WEIGHT_DECAY, Case

STOCK = ("torch-foreach", "torch-fused")
KEEP_SCALED = "+keep_scaled_grads"  # provider-name suffix: FusedAmpAdamW(keep_scaled_grads=True)
MODE = "@"  # provider-name separator of a memory mode: "ampfused-cpu@split8+int8"


def memory_mode(provider: str) -> str | None:
    """The ``configs.MEMORY_MODES`` name of a provider, None for the fp32-state ones."""
    return provider.split(MODE, 1)[1] if MODE in provider else None


class FreshGrads:
    """SETS copies of the case's gradients handed over in turn by every step: new grad tensors at unseen
    addresses, as zero_grad(set_to_none=True) + backward give."""

    SETS = 20

    def __init__(self, grads):
        self.sets, self.k = [[g.clone() for g in grads] for _ in range(self.SETS)], 0

    def restore(self, grads) -> None:
            torch._foreach_copy_(self.sets[self.k % self.SETS], grads)

    def hand_over(self, params) -> None:
        for p, g in zip(params, self.sets[self.k % self.SETS]):
            p.grad = g
        self.k += 1


class CaseData:
    """Seeded initial params (fp32) and gradients (per micro-batch, in the param dtype) of one case."""

    def __init__(self, case: Case, device: torch.device, seed: int = 0):
        config, gen = case.config, torch.Generator(device=device).manual_seed(seed)
        std, dtype = GRAD_STD * (INIT_SCALE if config.loss_scaling else 1.0), config.torch_dtype
        self.init = [torch.randn(s, generator=gen, device=device).mul_(0.02) for s in case.shapes.shapes]
        if config.low_precision:  # the master starts as the low-precision param, as FusedAmpAdamW does
            self.init = [t.to(dtype).float() for t in self.init]
        self.grads = [[torch.randn(s, generator=gen, device=device).mul_(std).to(dtype) for s in case.shapes.shapes]
                      for _ in range(config.micro_batches)]


class Provider:
    """One implementation on one case: ``step()`` is timed; ``results()``: {"master": fp32 weights, "param":
    params}; ``state_bytes()``: every tensor kept between steps."""

    name: str

    def __init__(self, case: Case, data: CaseData, device: torch.device):
        self.case, self.config, self.data, self.device = case, case.config, data, device

    def restore_grads(self) -> None:
        if self.fresh is not None:
            self.fresh.restore(self.data.grads[0])
        elif not self.config.low_precision:
            torch._foreach_copy_(self._grads(), self.data.grads[0])  # the fp32 grads step() reads

    def _state(self) -> list[Tensor]:
        return [t for s in self.opt.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim()]

    def close(self) -> None:
        """Drop every tensor (the next provider starts on a clean allocator)."""
        self.__dict__.clear()


class StockAdamW(Provider):
    def __init__(self, case, data, device, impl: str):
        super().__init__(case, data, device)
        self.name, cfg = f"torch-{impl}", self.config
        if cfg.low_precision:
            self.params = [t.to(cfg.torch_dtype, copy=True) for t in data.init]
            self.masters = [torch.nn.Parameter(t.clone()) for t in data.init]
            for m in self.masters:
                m.grad = torch.empty_like(m)
        else:
            self.params = self.masters = [torch.nn.Parameter(t.clone()) for t in data.init]
            for m, g in zip(self.masters, data.grads[0]):
                m.grad = g.clone()
        self.master_grads = [m.grad for m in self.masters]
        self.fresh = FreshGrads(data.grads[0]) if cfg.fresh_grads else None
        self.opt = torch.optim.AdamW(self.masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                     **{impl: True})
        self.scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                                           enabled=cfg.loss_scaling)
        self.scaler.scale(torch.ones((), device=device))  # creates the scale tensor, as a loop's scale(loss) does

    def _grads(self):
        return self.master_grads

    def step(self) -> None:
        if self.fresh is not None:
            self.fresh.hand_over(self.masters)
        if self.config.low_precision:
            for k, micro_batch in enumerate(self.data.grads):
                (torch._foreach_copy_ if k == 0 else torch._foreach_add_)(self.master_grads, micro_batch)
        self.scaler.unscale_(self.opt)
        if self.config.clip:
            torch.nn.utils.clip_grad_norm_(self.masters, MAX_GRAD_NORM, foreach=True)
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.config.low_precision:
            torch._foreach_copy_(self.params, self.masters)

    def results(self):
        return {"master": [m.detach() for m in self.masters], "param": [p.detach() for p in self.params]}

    def state_bytes(self) -> int:
        return measure.storage_bytes([*self.params, *self.masters, *self.master_grads, *self._state()])


class AmpfusedAdamW(Provider):
    def __init__(self, case, data, device, backend: str, keep_scaled_grads: bool = False, mode: str | None = None):
        super().__init__(case, data, device)
        self.name = f"ampfused-{backend}" + (KEEP_SCALED if keep_scaled_grads else "") + (MODE + mode if mode else "")
        cfg = self.config
        self.params = [torch.nn.Parameter(t.to(cfg.torch_dtype, copy=True)) for t in data.init]
        self.opt = ampfused.FusedAmpAdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                          max_grad_norm=MAX_GRAD_NORM if cfg.clip else None,
                                          keep_scaled_grads=keep_scaled_grads, backend=backend,
                                          **(MEMORY_MODES[mode] if mode else {}))
        self.scaler = ampfused.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                                          enabled=cfg.loss_scaling)
        self.scaler.scale(torch.ones((), device=device))
        if not cfg.low_precision:
            for p, g in zip(self.params, data.grads[0]):
                p.grad = g.clone()
        self.fresh = FreshGrads(data.grads[0]) if cfg.fresh_grads else None
        # the hooks FusedAmpAdamW registered with register_post_accumulate_grad_hook, called as autograd calls
        # them once a param's .grad is final; and the C++ pre-hook on the AccumulateGrad node of CPU params
        # (csrc/accumulate_hook.cpp), which adds micro-batches 2..N with ampfused::accumulate
        self.hooks = [list(p._post_accumulate_grad_hooks.values()) if p._post_accumulate_grad_hooks else [] for p in self.params]
        self.pre_hooked = [self.opt.main_grads.has_cpu_hook(p) for p in self.params]

    def _grads(self):  # (a scaled step wrote the unscaled gradient into p.grad)
        return [p.grad for p in self.params]

    def step(self) -> None:
        if self.fresh is not None:
            self.fresh.hand_over(self.params)
        if self.config.low_precision:
            for micro_batch in self.data.grads:
                for p, g, first, hooks, pre_hooked in zip(self.params, micro_batch, self.data.grads[0], self.hooks,
                                                          self.pre_hooked):
                    # what AccumulateGrad does in a no-grad backward: hand a fresh grad over, else add in place
                    if p.grad is None:
                        p.grad = g
                    elif pre_hooked and p.grad is p.main_grad:
                        torch.ops.ampfused.accumulate(p.main_grad, g)
                    elif p.grad is first:  # no fp32 accumulation: the case's own tensor, which later steps hand over again
                        p.grad = p.grad + g
                    else:
                        p.grad += g
                    for hook in hooks:
                        hook(p)
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.config.low_precision:
            self.opt.zero_grad()

    def results(self):
        masters = ([_compact.decode_state(self.opt.state[p], p).get("master_param", p.float()) for p in self.params]
                   if self.config.low_precision else [p.detach() for p in self.params])  # (a compact master decoded)
        return {"master": masters, "param": [p.detach() for p in self.params]}

    def state_bytes(self) -> int:
        grads = [p.grad for p in self.params if p.grad is not None]
        main_grads = [p.main_grad for p in self.params if getattr(p, "main_grad", None) is not None]
        # without fp32 accumulation the step reads autograd's low-precision p.grad, kept from the last backward
        # to zero_grad (which has dropped it by now): one gradient of the param's size and dtype
        read = [g for p, g in zip(self.params, self.data.grads[-1]) if p.grad is None and getattr(p, "main_grad", None) is None]
        return measure.storage_bytes([*self.params, *grads, *main_grads, *self._state()]) + sum(
            g.numel() * g.element_size() for g in read)


def make(name: str, case: Case, data: CaseData, device: torch.device) -> Provider:
    if name in STOCK:
        return StockAdamW(case, data, device, name.split("-", 1)[1])
    backend, _, mode = name.split("-", 1)[1].partition(MODE)
    return AmpfusedAdamW(case, data, device, backend.removesuffix(KEEP_SCALED), keep_scaled_grads=backend.endswith(KEEP_SCALED),
                         mode=mode or None)


# ---------------------------------------------------------------- bytes model


def bytes_per_param(provider: str, case: Case) -> float:
    """Bytes one step moves per parameter, by the pass structure of each implementation, at one read
    or write per operand (the formulas: benchmarks/README.md §1, "B/param")."""
    cfg = case.config
    s, c = int(cfg.loss_scaling), int(cfg.clip)
    lp = cfg.torch_dtype.itemsize if cfg.low_precision else 0
    n = cfg.micro_batches
    if provider in STOCK:
        core = 8 * s + 12 * c + 28
        if not cfg.low_precision:
            return core
        return (lp + 4) + (n - 1) * (lp + 8) + core + (4 + lp)
    mode = memory_mode(provider)
    grad_write = 4 * s * (KEEP_SCALED not in provider)
    if not cfg.low_precision:
        return 32 + grad_write
    update = 28 + lp
    if mode is None:
        return (lp + 4) + (n - 1) * (lp + 8) + 4 + update + grad_write
    kwargs = MEMORY_MODES[mode]
    master = {None: 4, "split16": 2, "split8": 1, False: 0}[kwargs.get("master_weights")]
    scales = 2 * 4 / _compact.BLOCK  # an fp32 scale per block, per moment
    moments = {None: 8, torch.bfloat16: 4, "int8": 2 + scales, "int4": 1 + scales}[kwargs.get("state_dtype")]
    # fp32 accumulation follows master weights unless the mode says otherwise (FusedAmpAdamW's default)
    if kwargs.get("fp32_grad_accumulation", master > 0):
        return (lp + 4) + (n - 1) * (lp + 8) + 4 + (4 + 2 * master + 2 * moments + lp + (lp if master < 4 else 0)) + grad_write
    # autograd's p.grad in the param dtype: micro-batches 2..N added in place, then read by the stats pass and the update
    grad_write = lp * s * (KEEP_SCALED not in provider)
    return (n - 1) * 3 * lp + lp + (lp + 2 * master + 2 * moments + 2 * lp) + grad_write
