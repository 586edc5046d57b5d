"""FusedAmpAdamW: validation, lazy flat state, fp32 gradient accumulation hooks, step()."""
from __future__ import annotations

import copy
import math
from collections import defaultdict
from itertools import chain

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import _backends, _compiled, _dtensor, _main_grad, distributed, functional
from ._flat import PARAM_DTYPES, SUPPORTED_DTYPES, FlatBuffer, check_grad as _check_grad, is_dense
from ._plan import StepPlan

LOW_PRECISION = (torch.float16, torch.bfloat16)
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
# [note: implementation keys] torch.optim.AdamW's param groups carry these; code that indexes them
# must find values that describe this optimizer: always fused, capturable (no host sync in step()),
# decoupled weight decay, never differentiable. state_dict() writes torch's defaults instead, so a
# checkpoint loads into torch.optim.AdamW and runs there as a fresh AdamW would.
IMPLEMENTATION_KEYS = dict(foreach=False, fused=True, capturable=True, differentiable=False, decoupled_weight_decay=True)
TORCH_IMPLEMENTATION_DEFAULTS = dict(foreach=None, fused=None, capturable=False, differentiable=False, decoupled_weight_decay=True)


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    elif not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate (lr): {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value (eps): {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor):  # as torch: a 1-element tensor, read as a float at each step
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element, got shape {tuple(beta.shape)}")
            beta = beta.item()
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i} (betas[{i}]): {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class FusedAmpAdamW(Optimizer):
    r"""AdamW fused with the mixed-precision bookkeeping around it.

    A drop-in replacement for :class:`torch.optim.AdamW` (pair it with :class:`ampfused.GradScaler`
    for fp16). For the gradients ``g`` of one ``step()`` (scaled by ``S`` when a scaler drives it):

    .. math::
        \begin{aligned}
            &u \leftarrow g / S \text{ for every param};\quad n \leftarrow \lVert u \rVert_2
                \text{ over all params of all groups}                                     \\
            &\textbf{if } n \text{ is not finite: skip the whole step (nothing changes)}     \\
            &u \leftarrow u \cdot \min(1, c / (n + 10^{-6}))
                \quad\text{when } \texttt{max\_grad\_norm} = c                             \\
            &\textbf{per param } \theta \text{ (its fp32 master copy for fp16/bf16):}      \\
            &\hspace{5mm} t \leftarrow t + 1;\quad \textbf{if } maximize: u \leftarrow -u  \\
            &\hspace{5mm}\theta \leftarrow \theta - \gamma \lambda \theta                 \\
            &\hspace{5mm} m \leftarrow \beta_1 m + (1 - \beta_1) u;\quad
                v \leftarrow \beta_2 v + (1-\beta_2) u^2                                    \\
            &\hspace{5mm}\widehat{v} \leftarrow \max(\widehat{v}, v) \text{ if amsgrad else } v \\
            &\hspace{5mm}\theta \leftarrow \theta - \frac{\gamma}{1-\beta_1^t}\,
                m \Big/ \Big(\sqrt{\widehat{v}} / \sqrt{1-\beta_2^t} + \epsilon\Big)          \\
            &\hspace{5mm}p \leftarrow \mathrm{round\_nearest\_even}(\theta)
                \text{ for an fp16/bf16 param } p
        \end{aligned}

    Args:
        params: iterable of parameters or param-group dicts (fp32, fp16 or bf16, one device).
        lr, betas, eps, weight_decay, amsgrad, maximize: as :class:`torch.optim.AdamW`.
        max_grad_norm (float, optional): clip the global L2 norm of the unscaled gradients to this
            value inside the step (``torch.nn.utils.clip_grad_norm_`` semantics).
        master_weights (bool, optional): keep fp32 master copies of fp16/bf16 params in
            ``state["master_param"]``. ``None``: on for every fp16/bf16 param.
        skip_nonfinite (bool): ``True`` (default): a step whose gradients hold an inf/NaN is
            skipped, with or without a scaler. ``False``: without a scaler the guard is off and
            non-finite gradients flow into the update as in :class:`torch.optim.AdamW` (with
            ``max_grad_norm``, as ``clip_grad_norm_`` scales them); a plain step (no scaler, no
            clipping) is then one pass, and ``opt.grad_norm`` is ``None`` (nothing computes it).
            A scaler's steps are always checked and skipped.
        keep_scaled_grads (bool): after a scaled step (``scaler.step(opt)`` without an earlier
            ``unscale_``), ``p.grad`` holds the unscaled gradient ``g / S``, as torch's fused AdamW
            leaves it (a skipped step leaves it scaled, as torch does). ``True`` keeps the scaled
            gradient and saves that write (4 B per param for fp32 gradients).
        fp32_grad_accumulation (bool, optional): accumulate fp16/bf16 gradients in fp32 during
            backward: ``p.grad`` is then an fp32 tensor (a view of optimizer-owned flat storage, also
            reachable as ``p.main_grad``) that ``clip_grad_norm_``, ``torch.amp.GradScaler`` and hooks
            read as on an fp32 model. ``None``: on wherever master weights are on.
        backend (str, optional): ``"cuda"``, ``"triton"``, ``"cpu"`` or ``"reference"``; ``None``
            picks the best available (overridable with ``AMPFUSED_BACKEND``).

    After each step, ``opt.grad_norm`` is the 0-d device tensor norm ``n`` (non-finite when the step
    was skipped). Nothing in ``step()`` synchronizes the host with the device. Clipping with
    ``max_grad_norm`` is the fast path (no extra pass over the gradients); the user's own
    ``clip_grad_norm_`` on ``p.grad`` works too.
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale/found_inf

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, max_grad_norm=None, master_weights=None, skip_nonfinite=True, keep_scaled_grads=False,
                 fp32_grad_accumulation=None, backend=None, foreach=None, fused=None, capturable=False,
                 differentiable=False):
        # foreach/fused/capturable are accepted so torch.optim.AdamW call sites keep working: this
        # optimizer is always fused and capturable (see [note: implementation keys]).
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (a positive finite float or None)")
        functional.check_flag(skip_nonfinite, "skip_nonfinite")
        functional.check_flag(keep_scaled_grads, "keep_scaled_grads")
        if differentiable:
            raise ValueError("differentiable=True is not supported by FusedAmpAdamW")
        if backend is not None:
            _backends.check_name(backend)
        # [note: optimizer-wide options] like max_grad_norm, these two act on the whole step (one stats
        # pass over every group), so they are attributes, not param-group keys: torch's state_dict
        # carries only groups and state, and a checkpoint stays loadable into torch.optim.AdamW
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.keep_scaled_grads = keep_scaled_grads
        self.master_weights = master_weights
        self.fp32_grad_accumulation = fp32_grad_accumulation
        self.grad_norm: Tensor | None = None
        self._backend_name = backend
        self.backend_reason: str | None = None  # why the backend was chosen, set when it is resolved
        self._init_runtime()
        # [distributed] one partition of a ZeroRedundancyOptimizer: stats summed over its group (see [note: ZeRO])
        self._zero_reducer = distributed.zero_stats_reducer()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        **IMPLEMENTATION_KEYS)
        super().__init__(params, defaults)
        self._params_registered = True
        if self._zero_reducer is not None and any(self._uses_main_grad(p) for p in self._all_params()):
            raise ValueError(
                "ZeroRedundancyOptimizer(optimizer_class=FusedAmpAdamW) with fp16/bf16 params and fp32 gradient accumulation "
                "is not supported: DDP all-reduces the gradients in the param dtype and cannot take the fp32 p.grad of a "
                "partition; pass fp32_grad_accumulation=False (master weights stay fp32), or use fp32 params under autocast")
        self._setup_main_grads()

    def _init_runtime(self) -> None:
        """Everything that is derived from the param groups and rebuilt, never pickled."""
        self._backend = None
        self._device = None
        self._param_dtypes: dict[Tensor, torch.dtype] = {}
        self._state_flat: dict[str, FlatBuffer] | None = None  # built at the first step
        self._state_index: dict[Tensor, int] = {}
        self._main_grads = _main_grad.MainGrads(self, self._setup_main_grads)
        self._plan: StepPlan | None = None  # the last step's tensor lists (see _plan.py)
        self._scratch = functional.Scratch()  # this optimizer's launch counters and partials (never copied)
        self._skipped: Tensor | None = None
        self._masters_pending: list[Tensor] = []  # loaded without master_param: copied from p at the next step
        self._zero_reducer = None  # a ZeroRedundancyOptimizer partition's stats reducer (set in __init__, not copied)
        self._params_registered = False  # main_grad storage is laid out once, after the initial groups

    def __getstate__(self) -> dict:
        return {"defaults": self.defaults, "state": self.state, "param_groups": self.param_groups,
                "max_grad_norm": self.max_grad_norm, "master_weights": self.master_weights,
                "skip_nonfinite": self.skip_nonfinite, "keep_scaled_grads": self.keep_scaled_grads,
                "fp32_grad_accumulation": self.fp32_grad_accumulation, "grad_norm": self.grad_norm,
                "_backend_name": self._backend_name, "backend_reason": self.backend_reason,
                "_masters_pending": self._masters_pending}

    def __setstate__(self, state: dict) -> None:
        """After copy.deepcopy / pickle / torch.load: flat state, main grads and hooks rebuilt on the (copied) params."""
        pending = state.pop("_masters_pending", [])
        state.setdefault("skip_nonfinite", True)  # pickled before these options existed
        state.setdefault("keep_scaled_grads", False)
        super().__setstate__(state)
        self._init_runtime()
        self._masters_pending = pending
        for p in self._all_params():
            self._check_param(p)
            self._param_dtypes[p] = p.dtype
        self._params_registered = True
        if any(self.state.values()):
            self._build_state_layout()
        self._setup_main_grads()

    def __repr__(self) -> str:
        lines = super().__repr__().split("\n")
        low = [p for p in self._all_params() if p.dtype in LOW_PRECISION]
        masters = sum(self._uses_master(p) for p in low)
        accumulated = sum(self._uses_main_grad(p) for p in low)
        backend = self._backend.NAME if self._backend is not None else (self._backend_name or "auto (resolved at the first step)")
        lines.insert(1, f"  backend: {backend}, max_grad_norm: {self.max_grad_norm}, "
                        f"skip_nonfinite: {self.skip_nonfinite}, keep_scaled_grads: {self.keep_scaled_grads}, "
                        f"fp32 master weights: {masters} of {len(low)} fp16/bf16 params, "
                        f"fp32 grad accumulation: {accumulated} of {len(low)}")
        return "\n".join(lines)

    # ---------------------------------------------------------------- param registration

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        param_group = {**param_group, "params": params}  # a generator must survive being read twice
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]  # named_parameters() gives (name, param)
        for p in tensors:
            self._check_param(p)
        if len({id(p) for p in tensors}) != len(tensors):
            # torch.optim.AdamW warns and applies such a param twice per step; one fused launch cannot
            raise ValueError("a parameter group lists the same parameter more than once: list each parameter once")
        _dtensor.check_params(self._all_params() + tensors)  # [distributed] DTensors: all or none, one mesh
        group_options = {k: v for k, v in param_group.items() if k != "params"}
        merged = {**self.defaults, **group_options}
        _check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        param_group.update({k: v for k, v in IMPLEMENTATION_KEYS.items() if k in param_group})
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._param_dtypes[p] = p.dtype
        self._state_flat = None  # new params: the flat state is re-laid out at the next step
        self._plan = None
        if self._params_registered:
            self._setup_main_grads()

    def _check_param(self, p) -> None:
        if not isinstance(p, Tensor):
            raise TypeError(f"optimizer params must be Tensors, got {type(p).__name__}")
        if p.dtype not in PARAM_DTYPES:
            raise ValueError(f"parameter dtype {p.dtype} is not supported: FusedAmpAdamW takes float32, float16, bfloat16, "
                             "float64, complex64 and complex128 params")
        if p.is_sparse:
            raise ValueError("sparse parameters are not supported by FusedAmpAdamW")
        if not is_dense(p):
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} with strides {p.stride()} is a view with gaps or overlaps "
                "(e.g. a slice or an expand of another tensor): FusedAmpAdamW steps dense params of any memory format; "
                "pass a tensor of its own (p.clone() or p.contiguous())")
        if _dtensor.is_dtensor(p) and p.dtype in LOW_PRECISION and self.fp32_grad_accumulation:
            raise ValueError(
                "fp32_grad_accumulation=True with a DTensor (FSDP2) parameter: FSDP2 writes the sharded gradients itself; "
                "keep the sharded params fp32 and ask FSDP2 for fp32 gradients with "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
        if self._device is None:
            self._device = p.device
        elif p.device != self._device:
            raise ValueError(f"params on several devices ({self._device} and {p.device}): use one FusedAmpAdamW per device")

    def _uses_master(self, p: Tensor) -> bool:
        return p.dtype in LOW_PRECISION and self.master_weights is not False

    def _uses_main_grad(self, p: Tensor) -> bool:
        if p.dtype not in LOW_PRECISION or _dtensor.is_dtensor(p):  # [distributed] FSDP2 owns DTensor grads
            return False
        if self.fp32_grad_accumulation is None:
            return self._uses_master(p)
        return bool(self.fp32_grad_accumulation)

    def _all_params(self) -> list[Tensor]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    # ---------------------------------------------------------------- fp32 gradient accumulation

    def _setup_main_grads(self) -> None:
        """(Re)build the flat fp32 gradient storage and hook every param that needs it (``_main_grad``)."""
        candidates = [p for p in self._all_params() if self._uses_main_grad(p)]
        if candidates and not _main_grad.SUPPORTED:
            raise RuntimeError(_main_grad.UNSUPPORTED_MESSAGE)
        if candidates and self._device.type == "cpu":
            _compiled.load()  # registers the C++ accumulation hook op where _C is built
        # a param frozen after it was laid out keeps its storage (it may be unfrozen again); one frozen
        # before gets none until its first gradient (MainGrads.watch)
        laid_out = [p for p in candidates if p.requires_grad or self._main_grads.owns(p)]
        self._main_grads.setup(laid_out, self._device)
        self._main_grads.watch([p for p in candidates if not p.requires_grad])  # (skips the laid-out ones)

    # ---------------------------------------------------------------- backend and state

    def _get_backend(self):
        if self._backend is None:
            self._backend, self.backend_reason = _backends.resolve(self._backend_name, self._device)
        return self._backend

    @property
    def backend(self) -> str:
        """Name of the backend serving this optimizer (resolved on first use)."""
        return self._get_backend().NAME

    def _build_state_layout(self) -> None:
        """Allocate flat state for every param (old contents copied) and re-point state views."""
        params = self._all_params()
        amsgrad = [p for g in self.param_groups if g["amsgrad"] for p in g["params"]]
        masters = [p for p in params if self._uses_master(p)]
        local = _dtensor.local_tensors  # [distributed] flat storage holds DTensor params' local shards
        flat_params, flat_amsgrad = ([p for p in ps if p.dtype in SUPPORTED_DTYPES] for ps in (params, amsgrad))
        flat = {"exp_avg": FlatBuffer(local(flat_params), self._device), "exp_avg_sq": FlatBuffer(local(flat_params), self._device)}
        if flat_amsgrad:
            flat["max_exp_avg_sq"] = FlatBuffer(local(flat_amsgrad), self._device)
        if masters:
            flat["master_param"] = FlatBuffer(local(masters), self._device)
        steps = torch.zeros(len(params), dtype=torch.float32, device=self._device)
        index = {p: i for i, p in enumerate(params)}
        slots = {key: {p: i for i, p in enumerate(ps)} for key, ps in (("exp_avg", flat_params), ("exp_avg_sq", flat_params), ("max_exp_avg_sq", flat_amsgrad), ("master_param", masters))}
        slots["max_exp_avg_sq"].update((p, None) for p in amsgrad if p.dtype not in SUPPORTED_DTYPES)
        for p, state in self.state.items():
            if not state:
                continue
            steps[index[p]].copy_(state["step"])
            state["step"] = steps[index[p]]
            if p.dtype not in SUPPORTED_DTYPES:  # [note: wide params] their state keeps its own tensors
                continue
            for key in MOMENT_KEYS:
                if key in state:
                    view = flat[key].views[slots[key][p]]
                    view.copy_(_dtensor.local(state[key]))
                    state[key] = _dtensor.like_param(view, p)
        self._state_flat, self._steps_flat, self._state_index, self._slots = flat, steps, index, slots
        self._plan = None  # the cached lists hold the old views

    def _view(self, key: str, p: Tensor) -> Tensor:
        """State ``key`` of ``p`` over the flat storage (a DTensor over the local view for a DTensor param)."""
        if p.dtype not in SUPPORTED_DTYPES:  # [note: wide params] a tensor of its own, in the param's dtype
            return torch.zeros_like(p, memory_format=torch.preserve_format)
        return _dtensor.like_param(self._state_flat[key].views[self._slots[key][p]], p)

    def _init_state(self, p: Tensor, amsgrad: bool) -> None:
        """Lazy per-param state, as torch.optim.AdamW creates it at a param's first step.

        A param whose group turned ``amsgrad`` on after it was stepped keeps its state and only
        gains a zero ``max_exp_avg_sq`` (where torch.optim.AdamW would raise a KeyError).
        """
        if self._state_flat is None or p not in self._state_index or (amsgrad and p not in self._slots["max_exp_avg_sq"]):
            self._build_state_layout()
        state = self.state[p]
        if not state:
            state["step"] = self._steps_flat[self._state_index[p]].zero_()
            state["exp_avg"] = self._view("exp_avg", p).zero_()
            state["exp_avg_sq"] = self._view("exp_avg_sq", p).zero_()
            if self._uses_master(p):
                state["master_param"] = self._view("master_param", p)
                _dtensor.local(state["master_param"]).copy_(_dtensor.local(p))
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = self._view("max_exp_avg_sq", p).zero_()

    # ---------------------------------------------------------------- step

    def _grads_to_step(self) -> list[tuple[Tensor, Tensor, dict]]:
        """(param, p.grad, group) for every param that has a gradient; validates before any write."""
        if self._device is not None and self._device.type == "meta":
            raise RuntimeError("FusedAmpAdamW cannot step parameters on the meta device (they hold no data): "
                               "materialize the model first (e.g. model.to_empty(device=...) and initialize it)")
        self._main_grads.relayout_if_strides_changed()
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != self._param_dtypes[p] or p.device != self._device:
                    raise RuntimeError(
                        f"a parameter changed from {self._param_dtypes[p]} on {self._device} to {p.dtype} on {p.device} "
                        "after the optimizer was built (e.g. model.half() afterwards): build the optimizer after converting the model")
                grad = p.grad
                if grad is None:
                    continue
                if grad is not getattr(p, "main_grad", None):  # main_grad is valid by construction
                    if not is_dense(p):
                        raise RuntimeError(
                            f"a parameter of shape {tuple(p.shape)} became a view with gaps or overlaps (strides "
                            f"{p.stride()}) after the optimizer was built (p.data was replaced by a slice?): keep params dense")
                    _check_grad(p, grad)
                    if grad.stride() != p.stride():  # in place, so an unscale_ reaches what the step reads
                        p.grad = grad = torch.empty_like(p, dtype=grad.dtype).copy_(grad)
                out.append((p, grad, group))
        return out

    def _make_plan(self) -> StepPlan:
        """Validate every param and grad, create lazy state, and cache the step's tensor lists."""
        work = self._grads_to_step()
        for p, _, group in work:  # may re-lay out the flat state: finish before taking views
            state = self.state[p]
            if not state or (group["amsgrad"] and "max_exp_avg_sq" not in state):
                self._init_state(p, group["amsgrad"])
            elif state["exp_avg"].stride() != p.stride():  # memory format changed: state follows the param
                self._build_state_layout()
        self._plan = StepPlan(self.param_groups, work, self.state, self._scratch.for_new_plan())
        return self._plan

    # [note: torch.compile] the step is already fused kernels behind lazily built flat state and
    # pointer tables, which dynamo cannot trace: a compiled opt.step() (or a compiled train step that
    # calls it) graph-breaks here and runs the step eagerly, with identical results. torch's lazy
    # form of torch.compiler.disable (what Optimizer.zero_grad uses): importing ampfused must not
    # import torch._dynamo (seconds, and it probes triton).
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step (skipped, bitwise, when any gradient is inf/NaN).

        Args:
            closure (Callable, optional): reevaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self._skipped = None  # the skip flag of this step, a device scalar (read by ampfused.GradScaler)
        plan = self._plan if self._plan is not None and self._plan.still_valid(self.param_groups, self.state) else self._make_plan()
        if self._masters_pending:
            self._copy_pending_masters()
        if not plan.params:
            needs_stats = functional.needs_stats(grad_scale, found_inf, self.max_grad_norm, self.skip_nonfinite)
            if self._zero_reducer is not None and needs_stats:  # [distributed] an empty ZeRO partition still joins
                self._zero_reducer.join(self._device)
            return loss
        hypers = plan.hypers()
        lists = [plan.params, plan.grads, plan.exp_avgs, plan.exp_avg_sqs, plan.max_exp_avg_sqs, plan.masters]
        reduce_stats = self._zero_reducer  # [distributed] a ZeRO partition's stats cover every partition
        if _dtensor.is_dtensor(plan.params[0]):  # [distributed] all or none (add_param_group): local shards, global stats
            lists, reduce_stats = _dtensor.localize(*lists)
        self.grad_norm, skipped = functional.run_step(
            self._get_backend(), *lists[:5], plan.steps, lists[5], hypers,
            max_grad_norm=self.max_grad_norm, grad_scale=grad_scale, found_inf=found_inf,
            skip_nonfinite=self.skip_nonfinite, keep_scaled_grads=self.keep_scaled_grads, reduce_stats=reduce_stats,
            scratch=plan.scratch, wide=plan.wide)
        plan.release_grads()  # [note: grads held weakly] in _plan.py
        self._skipped = skipped
        return loss

    def _copy_pending_masters(self) -> None:
        for p in self._masters_pending:
            state = self.state.get(p)
            if state and "master_param" in state:  # (not if the state was reset since the load)
                _dtensor.local(state["master_param"]).copy_(_dtensor.local(p))
        self._masters_pending = []

    # ---------------------------------------------------------------- GradScaler support

    @torch.no_grad()
    def _unscale_grads_(self, inv_scale: Tensor, found_inf: Tensor) -> None:
        """Unscale every gradient this optimizer will read, for GradScaler.unscale_ (fp16 and bf16 grads too)."""
        from ._amp import unscale_and_check_

        work = self._grads_to_step()
        if work:  # [distributed] local shards; the step all-reduces found_inf with the stats
            unscale_and_check_(_dtensor.local_tensors([g for _, g, _ in work]), inv_scale.to(self._device), found_inf)

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """torch.optim.AdamW's state dict (its keys, shapes and fp32 state) plus ``master_param``.

        The param groups carry torch.optim.AdamW's defaults for ``foreach``/``fused``/``capturable``
        (see [note: implementation keys]), so the dict loads into either class.
        """
        if self._masters_pending:
            with torch.no_grad():
                self._copy_pending_masters()
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group.update(TORCH_IMPLEMENTATION_DEFAULTS)
        return state_dict

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of FusedAmpAdamW or torch.optim.AdamW.

        State stays fp32 whatever the param dtype (torch's base class would cast it to the param
        dtype); master weights missing from the dict are created from the current params.
        Everything is validated before anything is written.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(self.param_groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
        id_map = dict(zip(chain.from_iterable(s["params"] for s in saved_groups), self._all_params()))
        amsgrad_of = {p: s.get("amsgrad", False) for s in saved_groups for p in s["params"]}
        saved_state = state_dict["state"]
        steps = {}
        for key, values in saved_state.items():
            if key not in id_map:
                raise ValueError(f"loaded state dict has state for parameter index {key!r}, which no parameter group lists")
            p = id_map[key]
            missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in values]
            if missing:
                raise ValueError(f"state of parameter {key} lacks {missing}: not an AdamW state dict")
            for name in MOMENT_KEYS:
                if name in values:  # [distributed] sharded state must come as DTensors
                    _dtensor.check_state(p, values[name], f"state {name!r} of parameter {key}")
                if name in values and tuple(values[name].shape) != tuple(p.shape):
                    raise ValueError(
                        f"state {name!r} of parameter {key} has shape {tuple(values[name].shape)} but the parameter has "
                        f"shape {tuple(p.shape)}: the state dict belongs to another model or optimizer")
            step = torch.as_tensor(values["step"], dtype=torch.float32)  # torch saves 0-d or 1-element steps
            if step.numel() != 1:
                raise ValueError(f"state 'step' of parameter {key} has shape {tuple(step.shape)}; expected a scalar")
            steps[key] = step.reshape(())
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
            group.update(IMPLEMENTATION_KEYS)
            group["betas"] = tuple(group["betas"])
        self.state = defaultdict(dict)
        self._build_state_layout()
        self._masters_pending = []
        for key, values in saved_state.items():
            p = id_map[key]
            self._init_state(p, bool(amsgrad_of[key]))
            state = self.state[p]
            state["step"].copy_(steps[key])
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                if name in values and name in state:
                    _dtensor.copy_state_(state[name], values[name])
            if "master_param" in state and "master_param" not in values:
                # [note: masters of a torch checkpoint] taken from p at the next step, not now: a script
                # may load the model's weights after the optimizer's, as it may with torch.optim.AdamW
                self._masters_pending.append(p)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
