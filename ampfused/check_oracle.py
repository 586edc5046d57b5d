"""The oracle of `python -m ampfused check`: each case stepped with no ampfused backend at all.

Where torch defines the result, torch computes it: the gradients come from autograd, the loss
scale, unscaling and the scale's update from ``torch.amp.GradScaler``, the clip from
``torch.nn.utils.clip_grad_norm_``, and every param whose state torch has a form for (fp32 moments,
with an fp32 master for a 16-bit param) is stepped by ``torch.optim.AdamW`` (single-tensor, as the
reference reproduces it) on its fp32 copy -- the hand-written fp32-master recipe:
``master = p.float()``; the step updates ``master``; ``p = master.to(p.dtype)``.

Where torch has no form (a 16-bit param without master, bf16 or int8 moments, split masters,
stochastic rounding), each tensor steps through the executable specification,
``ampfused._compact.compact_adamw_step_``, fed the gradient torch unscaled and clipped.

What DESIGN §2 and §3 add to torch is written here by hand, in plain torch: the whole step is
skipped when any unscaled gradient element is inf/NaN (with or without a scaler); the micro-batch
gradients of a 16-bit param sum in fp32 when fp32 accumulation is on; ``p.grad`` after a scaled
step holds the unscaled gradient in the grad's dtype (as torch's fused AdamW leaves it) and is
untouched otherwise; ``skipped_steps`` counts the skipped steps.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import _compact

F32 = torch.float32


def _master_mode(master_weights) -> str:
    """FusedAmpAdamW's ``master_weights`` as the spec names it."""
    return "none" if master_weights is False else "fp32" if master_weights in (None, True) else master_weights


def _has_torch_form(param: Tensor, state: dict) -> bool:
    """Whether torch's AdamW keeps this state: fp32 moments and fp32 weights (the param, or a master)."""
    moments = [state[k] for k in _compact.MOMENTS if k in state]
    fp32_weights = param.dtype == F32 or set(state) & set(_compact.MASTER_KEYS.values()) == {"master_param"}
    return (fp32_weights and all(m.dtype == F32 for m in moments)
            and not any(_compact.is_compact_key(k) for k in state))


class Oracle:
    """One case's params stepped by torch (and the spec where torch has no form), one step at a time.

    ``targets(step, micro)`` gives the fp32 tensors ``G`` of the loss ``sum(p.float() * G)``,
    the loss the run under test backpropagates."""

    def __init__(self, case, params: list[Tensor], targets: Callable[[int, int], list[Tensor]]):
        options = case.options
        self.case, self.targets = case, targets
        self.device = params[0].device
        self.params = [p.detach().clone() for p in params]
        self.amsgrad = options.get("amsgrad", False)
        self.lr = options.get("lr", 1e-3)
        if case.tensor_lr:
            self.lr = torch.tensor(self.lr, device=self.device)
        self.hyper = dict(betas=options.get("betas", (0.9, 0.999)), eps=options.get("eps", 1e-8),
                          weight_decay=options.get("weight_decay", 1e-2), amsgrad=self.amsgrad,
                          maximize=options.get("maximize", False))
        master_mode = _master_mode(options.get("master_weights"))
        accumulation = options.get("fp32_grad_accumulation")
        self.fp32_accumulation = master_mode != "none" if accumulation is None else accumulation
        self.max_grad_norm = options.get("max_grad_norm")
        self.stochastic = options.get("stochastic_rounding", False)
        self.skip_nonfinite = case.scaler is not None or options.get("skip_nonfinite", True)
        self.keep_scaled_grads = options.get("keep_scaled_grads", False)
        # spec[i]: the compact state of param i, or None where torch's AdamW steps its fp32 copy
        self.spec = []
        for p in self.params:
            state = _compact.init_state(p, master_mode, options.get("state_dtype") or F32, self.amsgrad)
            self.spec.append(None if _has_torch_form(p, state) else state)
        # masters[i]: the fp32 copy torch steps, or for a spec param only the carrier of its fp32 grad
        self.masters = [p.detach().float().clone() for p in self.params]
        stepped = [m for m, s in zip(self.masters, self.spec) if s is None]
        self.torch_adamw = torch.optim.AdamW(stepped, lr=self.lr, foreach=False, **self.hyper) if stepped else None
        self.scaler = torch.amp.GradScaler(self.device.type, **case.scaler) if case.scaler else None
        # GradScaler unscales the grads of an optimizer's params: this one holds every fp32 grad and never steps
        self.grad_holder = torch.optim.SGD(self.masters, lr=0.0)
        self.skipped_steps = 0
        self.grads: list[Tensor] = []
        self.grad_norm: Tensor | None = None

    def _backward(self, step: int) -> list[Tensor]:
        """Each param's gradient as the run accumulates it over the step's micro-batches."""
        accumulated: list[Tensor | None] = [None] * len(self.params)
        for micro in range(self.case.micro_batches):
            leaves = [p.detach().clone().requires_grad_() for p in self.params]
            loss = sum((leaf.float() * t.to(self.device)).sum() for leaf, t in zip(leaves, self.targets(step, micro)))
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            for i, leaf in enumerate(leaves):
                grad = leaf.grad
                if self.fp32_accumulation:  # DESIGN §3: 16-bit micro-batch grads summed in fp32, in order
                    grad = grad.float()
                accumulated[i] = grad if accumulated[i] is None else accumulated[i] + grad
        return accumulated

    def step(self, step: int) -> None:
        grads = self._backward(step)
        with torch.no_grad():
            self._update(step, grads)

    def _update(self, step: int, grads: list[Tensor]) -> None:
        for master, grad in zip(self.masters, grads):
            master.grad = grad.to(F32, copy=True)  # a copy: unscaling and clipping write into it
        if self.scaler is not None:
            self.scaler.unscale_(self.grad_holder)
        unscaled = [m.grad.clone() for m in self.masters]
        skip = self.skip_nonfinite and not all(bool(torch.isfinite(u).all()) for u in unscaled)  # DESIGN §2.2
        if self.max_grad_norm is not None:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm, foreach=False)
        else:
            self.grad_norm = torch.nn.utils.get_total_norm(unscaled, foreach=False)
        torch.manual_seed(step)  # the run draws its stochastic-rounding seed after the same seeding
        seed = _compact.draw_rounding_seed(None, self.device) if self.stochastic else None
        if not skip:
            if self.torch_adamw is not None:
                self.torch_adamw.step()
            for i, (param, state, master) in enumerate(zip(self.params, self.spec, self.masters)):
                if state is None:
                    param.copy_(master.to(param.dtype))  # the recipe: the param is the rounding of its master
                else:
                    _compact.compact_adamw_step_(
                        param, master.grad, state, lr=self.lr, beta1=self.hyper["betas"][0],
                        beta2=self.hyper["betas"][1], eps=self.hyper["eps"], weight_decay=self.hyper["weight_decay"],
                        amsgrad=self.amsgrad, maximize=self.hyper["maximize"], stochastic_rounding=self.stochastic,
                        rounding_seed=seed, rounding_index=i)
        if self.scaler is not None:
            self.scaler.update()
            self.skipped_steps += skip
        # p.grad after the step (DESIGN §2.7): unscaled, in its own dtype, after a scaled step that ran
        unscale = self.scaler is not None and not skip and not self.keep_scaled_grads
        self.grads = [u.to(g.dtype) if unscale else g for u, g in zip(unscaled, grads)]
        if self.case.tensor_lr:
            self.lr.mul_(0.9)

    def snapshot(self) -> dict:
        """What ``check.Run.snapshot`` takes of a run, from the oracle: (what, param index or None) -> tensor."""
        snap = {}
        for i, (param, state, master) in enumerate(zip(self.params, self.spec, self.masters)):
            snap[("param", i)] = param.clone()
            snap[("grad", i)] = self.grads[i].clone()
            if state is None:
                state = dict(self.torch_adamw.state[master]) or self._fresh_state(param)
                if param.dtype != F32:
                    state["master_param"] = master
            for key, value in state.items():
                snap[(key, i)] = value.clone()
        if self.grad_norm is not None:
            snap[("grad_norm", None)] = self.grad_norm.clone()
        if self.scaler is not None:
            sd = self.scaler.state_dict()
            for key, value in (("scale", sd["scale"]), ("_growth_tracker", sd["_growth_tracker"]),
                               ("skipped_steps", self.skipped_steps)):
                snap[(key, None)] = torch.tensor(float(value), dtype=torch.float64)
        return snap

    def _fresh_state(self, param: Tensor) -> dict:
        """The state a run holds when its first step was skipped: torch's AdamW creates none until a step runs."""
        zeros = torch.zeros(param.shape, dtype=F32, device=param.device)
        state = {"step": torch.zeros((), dtype=F32, device=param.device), "exp_avg": zeros, "exp_avg_sq": zeros}
        if self.amsgrad:
            state["max_exp_avg_sq"] = zeros
        return state


def trajectory(case, params: list[Tensor], targets: Callable[[int, int], list[Tensor]]) -> list[dict]:
    """The oracle's snapshot after each of ``case.steps`` steps from ``params``."""
    oracle = Oracle(case, params, targets)
    snaps = []
    for k in range(case.steps):
        oracle.step(k)
        snaps.append(oracle.snapshot())
    return snaps

