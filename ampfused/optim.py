"""FusedAmpAdamW: torch.optim.AdamW's surface (arguments, param groups, hooks) over the fused step; the
state room (``_state``), state dicts (``_state_dict``), cached step lists (``_plan``), fp32 gradient
storage (``_main_grad``) and the step (``functional.run_step``) live in their own modules."""
from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import _args, _backends, _dtensor, _main_grad, _reducers, _state_dict, _unused_options, functional
from ._args import LOW_PRECISION
from ._plan import GroupRows, StepPlan, grads_to_step
from ._state import StateRoom, uses_master
from ._state_dict import IMPLEMENTATION_KEYS

_PICKLE_DEFAULTS = dict(skip_nonfinite=True, keep_scaled_grads=False, state_dtype=None, stochastic_rounding=False)
_PICKLED = ("defaults", "state", "param_groups", "max_grad_norm", "master_weights", "state_dtype", "stochastic_rounding",
            "skip_nonfinite", "keep_scaled_grads", "fp32_grad_accumulation", "grad_norm", "_backend_name", "backend_reason")


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
        master_weights (bool or str, optional): the master of fp16/bf16 params. ``None``/``True``/
            ``"fp32"``: fp32 ``master_param`` (4 B/param); ``"split16"`` (bf16): the param + its low
            16 bits (2 B, exact but a 1-ulp nudge at ties); ``"split8"``: the param + an 8-bit
            correction (1 B, within ``ulp(p)/256``); ``False``: none.
        state_dtype (optional): moments in fp32 (``None``), ``torch.bfloat16`` (4 B/param),
            ``"int8"`` (blockwise companded, ~2 B/param) or ``"int4"`` (4-bit codes of 16-level grids,
            two per byte, ~1 B/param; ``exp_avg_sq`` never decodes to 0 in a block whose maximum is
            not 0). Both blockwise modes keep an fp32 scale per 256 elements of a row and apply to
            tensors of two or more dimensions and at least 4096 elements (int4: an even last
            dimension); others keep fp32 moments. Encodings and keys: ``ampfused._compact``.
        stochastic_rounding (bool): round bf16 writes without an exact master stochastically, seeded
            from torch's default CPU generator at each step (``torch.manual_seed`` reproduces a run).
        skip_nonfinite (bool): ``True``: a step with an inf/NaN gradient is skipped, scaler or not.
            ``False``: without a scaler non-finite gradients flow into the update as in torch (a
            plain step is then one pass and ``opt.grad_norm`` is ``None``). A scaler always skips.
        keep_scaled_grads (bool): after a scaled step ``p.grad`` holds ``g / S``, as torch's fused
            AdamW leaves it; ``True`` keeps the scaled gradient and saves that write (4 B/param).
        fp32_grad_accumulation (bool, optional): accumulate fp16/bf16 gradients in fp32: ``p.grad``
            (and ``p.main_grad``) is an fp32 view of optimizer-owned storage. ``None``: with masters.
        backend (str, optional): ``"cuda"``, ``"triton"``, ``"cpu"`` or ``"reference"``; ``None``
            picks the best available (overridable with ``AMPFUSED_BACKEND``).
        partition_group (ProcessGroup, optional): the group whose ranks step the other partitions
            (``ZeroRedundancyOptimizer``): the clip norm and the skip cover every partition.

    After each step, ``opt.grad_norm`` is the 0-d device tensor norm ``n`` (non-finite when the step
    was skipped). Nothing in ``step()`` synchronizes the host with the device. Clipping with
    ``max_grad_norm`` is the fast path (no extra pass over the gradients); the user's own
    ``clip_grad_norm_`` on ``p.grad`` works too.
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale/found_inf

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, max_grad_norm=None, master_weights=None, state_dtype=None, stochastic_rounding=False,
                 skip_nonfinite=True, keep_scaled_grads=False, fp32_grad_accumulation=None, backend=None,
                 partition_group=None, foreach=None, fused=None, capturable=False, differentiable=False):
        # foreach/fused/capturable are accepted so torch.optim.AdamW call sites keep working: this
        # optimizer is always fused and capturable (see [note: implementation keys] in _state_dict).
        _args.check_options(lr, betas, eps, weight_decay, max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
                            keep_scaled_grads=keep_scaled_grads, differentiable=differentiable, backend=backend,
                            master_weights=master_weights, state_dtype=state_dtype,
                            stochastic_rounding=stochastic_rounding)
        # like max_grad_norm, these act on the whole step (one stats
        # pass over every group), so they are attributes, not param-group keys: torch's state_dict
        # carries only groups and state, and a checkpoint stays loadable into torch.optim.AdamW
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.keep_scaled_grads = keep_scaled_grads
        self.master_weights = master_weights
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.fp32_grad_accumulation = fp32_grad_accumulation
        self.grad_norm: Tensor | None = None
        self._backend_name = backend
        self.backend_reason: str | None = None  # why the backend was chosen, set when it is resolved
        self._init_runtime()
        # [distributed] one partition of a ZeroRedundancyOptimizer: stats summed over its group (see [note: ZeRO])
        self._partition_reducer = _reducers.partition_reducer(partition_group)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        **IMPLEMENTATION_KEYS)
        super().__init__(params, defaults)
        self._params_registered = True
        if self._partition_reducer is not None and any(self._uses_main_grad(p) for p in self._all_params()):
            raise ValueError(_reducers.ZERO_FP32_MESSAGE)
        self._setup_main_grads()
        _unused_options.warn_unused_options(_unused_options.unused_options(
            self._all_params(), self._master_mode, self._moments, stochastic_rounding, fp32_grad_accumulation,
            self._uses_main_grad), stacklevel=2)

    def _init_runtime(self) -> None:
        """Everything that is derived from the param groups and rebuilt, never pickled."""
        self._backend = None
        self._device = None
        self._param_dtypes: dict[Tensor, torch.dtype] = {}
        self._state_room = StateRoom(self)  # flat state, built at the first step
        self._main_grads = _main_grad.MainGrads(self, self._setup_main_grads)
        self._plan: StepPlan | None = None  # the last step's tensor lists (see _plan.py)
        self._scratch = functional.Scratch()  # this optimizer's launch counters and partials (never copied)
        self._skipped: Tensor | None = None
        self._partition_reducer = None  # set in __init__, not copied
        self._params_registered = False  # main_grad storage is laid out once, after the initial groups

    def __getstate__(self) -> dict:
        return {**{k: getattr(self, k) for k in _PICKLED}, "_masters_pending": self._state_room.masters_pending}

    def __setstate__(self, state: dict) -> None:
        """After copy.deepcopy / pickle / torch.load: flat state, main grads and hooks rebuilt on the (copied) params."""
        pending = state.pop("_masters_pending", [])
        state = {**_PICKLE_DEFAULTS, **state}  # pickled before these options existed
        super().__setstate__(state)
        self._init_runtime()
        self._state_room.masters_pending = pending
        for p in self._all_params():
            self._check_param(p)
            self._param_dtypes[p] = p.dtype
        self._params_registered = True
        if any(self.state.values()):
            self._state_room.layout()
        self._setup_main_grads()

    def __repr__(self) -> str:
        lines = super().__repr__().split("\n")
        low = [p for p in self._all_params() if p.dtype in LOW_PRECISION]
        masters = sum(uses_master(p, self.master_weights) for p in low)
        accumulated = sum(self._uses_main_grad(p) for p in low)
        backend = self._backend.NAME if self._backend is not None else (self._backend_name or "auto (resolved at the first step)")
        lines.insert(1, f"  backend: {backend}, max_grad_norm: {self.max_grad_norm}, "
                        f"skip_nonfinite: {self.skip_nonfinite}, keep_scaled_grads: {self.keep_scaled_grads}, "
                        f"{self._master_mode} master weights: {masters} of {len(low)} fp16/bf16 params, "
                        f"state_dtype: {_args.state_dtype_name(self._moments)}, stochastic_rounding: {self.stochastic_rounding}, "
                        f"fp32 grad accumulation: {accumulated} of {len(low)}")
        return "\n".join(lines)

    def add_param_group(self, param_group: dict) -> None:
        param_group = _args.check_param_group(param_group, self.defaults, self._all_params(), self._check_param)
        param_group.update({k: v for k, v in IMPLEMENTATION_KEYS.items() if k in param_group})
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._param_dtypes[p] = p.dtype
        self._state_room.invalidate()  # new params: the flat state is re-laid out at the next step
        self._plan = None
        if self._params_registered:
            self._setup_main_grads()

    def _check_param(self, p) -> None:
        self._device = _args.check_param(p, self.fp32_grad_accumulation, self._device)
        _args.check_param_modes(p, self._master_mode, self._moments, self.stochastic_rounding)

    _master_mode = property(lambda self: _args.master_mode(self.master_weights))  # "fp32", "split16", "split8", "none"
    _moments = property(lambda self: _args.state_encoding(self.state_dtype))  # torch.float32, torch.bfloat16, "int8"

    def state_bytes(self) -> int:
        """Bytes this optimizer keeps between steps, measured from its tensors' storages (state with its
        padding, step counters, int8 scales, and the fp32 gradient storage it owns; not the params)."""
        return self._state_room.kept_bytes(self._main_grads.flat)

    def _uses_main_grad(self, p: Tensor) -> bool:
        return _main_grad.wanted(p, self.fp32_grad_accumulation, self.master_weights)

    def _all_params(self) -> list[Tensor]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def _setup_main_grads(self) -> None:
        """(Re)build the flat fp32 gradient storage and hook every param that needs it (``_main_grad``)."""
        self._main_grads.sync([p for p in self._all_params() if self._uses_main_grad(p)], self._device)

    @property
    def backend(self) -> str:
        """Name of the backend serving this optimizer (resolved on first use)."""
        return self._get_backend().NAME

    @property
    def main_grads(self) -> _main_grad.MainGrads:
        """The fp32 gradient storage of the fp16/bf16 params accumulated in fp32 (``_main_grad.MainGrads``:
        ``params``, ``flat``, ``attach_reducer``, ``has_cpu_hook``); what ``data_parallel`` all-reduces."""
        return self._main_grads

    @property
    def step_skipped(self) -> Tensor | None:
        """The skip flag of the last ``step()``: a 0-d fp32 device tensor, non-zero when that step was
        skipped for inf/NaN gradients (what ``ampfused.GradScaler`` records as the step's found_inf);
        ``None`` before a step and after a step with no gradients. Reading its value synchronizes."""
        return self._skipped

    @torch.no_grad()
    def unscale_grads_(self, inv_scale: Tensor, found_inf: Tensor) -> None:
        """``g *= inv_scale`` for every gradient the next step reads, and ``found_inf = 1`` if any is
        inf/NaN (``ampfused.GradScaler.unscale_``; fp16 and bf16 gradients too). No host sync."""
        from ._amp import unscale_and_check_

        self._main_grads.relayout_if_strides_changed()
        plan = self._plan
        if plan is not None and plan.still_valid(self.param_groups, self.state):
            grads = plan.grads  # the grads the next step reads, in the layouts the plan checked
        else:
            grads = [g for _, g, _ in grads_to_step(self.param_groups, self._param_dtypes, self._device)]
        if grads:  # [distributed] local shards; the step all-reduces found_inf with the stats
            unscale_and_check_(_dtensor.local_tensors(grads), inv_scale.to(self._device), found_inf)
        if plan is not None:
            plan.release_grads()  # the step reads them again; no step may follow ([note: grads released])

    def _get_backend(self):
        if self._backend is None:
            self._backend, self.backend_reason = _backends.resolve(self._backend_name, self._device)
        return self._backend

    def _make_plan(self) -> StepPlan:
        """Check every param and grad, create lazy state, and cache the step's tensor lists."""
        self._main_grads.relayout_if_strides_changed()
        work = grads_to_step(self.param_groups, self._param_dtypes, self._device)
        rows = GroupRows(self.param_groups, work)  # edited group values are refused before lazy state is made
        self._state_room.prepare(work)
        self._plan = StepPlan(self.param_groups, work, self.state, self._scratch.for_new_plan(), rows)
        return self._plan

    # fused kernels behind lazy flat state and pointer tables, which dynamo cannot
    # trace: a compiled step graph-breaks here and runs eagerly, with identical results. torch's lazy
    # torch.compiler.disable (as Optimizer.zero_grad): importing ampfused must not import torch._dynamo.
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
        grad_scale = getattr(self, "grad_scale", None)  # set by a GradScaler (torch's protocol)
        found_inf = getattr(self, "found_inf", None)
        self._skipped = None
        plan = self._plan if self._plan is not None and self._plan.still_valid(self.param_groups, self.state) else self._make_plan()
        group_rows = plan.rows.current()  # [note: group rows] edited values raise here, before any write
        if self._state_room.masters_pending:
            self._state_room.copy_pending_masters()
        if not plan.params:
            needs_stats = functional.needs_stats(grad_scale, found_inf, self.max_grad_norm, self.skip_nonfinite)
            if self._partition_reducer is not None and needs_stats:  # [distributed] an empty ZeRO partition still joins
                self._partition_reducer.join(self._device)
            return loss
        batch, reduce_stats = plan.batch_for_step(group_rows)
        if not plan.is_dtensor:  # [distributed] a ZeRO partition's stats cover every partition
            reduce_stats = self._partition_reducer
        backend = self._get_backend()
        seed = functional.rounding_seed(self._device) if self.stochastic_rounding else None
        self.grad_norm, self._skipped = functional.run_step(backend, batch, functional.StepOptions(
            max_grad_norm=self.max_grad_norm, grad_scale=grad_scale, found_inf=found_inf,
            skip_nonfinite=self.skip_nonfinite, keep_scaled_grads=self.keep_scaled_grads, reduce_stats=reduce_stats,
            scratch=plan.scratch, rounding_seed=seed))
        plan.release_grads()  # [note: grads released] in _plan.py
        return loss

    def state_dict(self) -> dict:
        """torch.optim.AdamW's state dict (its keys, shapes and fp32 state) plus ``master_param``; in the
        compact modes the compact tensors under ``ampfused._compact``'s keys (``ampfused.checkpoint.
        to_torch_state_dict`` expands them into torch's form).

        The param groups carry torch.optim.AdamW's defaults for ``foreach``/``fused``/``capturable``
        (see [note: implementation keys]), so the dict loads into either class.
        """
        return _state_dict.state_dict(self)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of FusedAmpAdamW or torch.optim.AdamW.

        Everything is validated before anything is written. The compact form loads bitwise into the same
        modes (another mode is refused, saying how to convert); torch's fp32 form loads into any mode.
        fp32 state stays fp32 (torch would cast it to the param dtype); missing masters come from the params.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        _state_dict.apply(self, _state_dict.validate(self.param_groups, state_dict, self._state_room.keys))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

