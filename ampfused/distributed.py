"""DistributedDataParallel for fp16/bf16 params whose gradients FusedAmpAdamW accumulates in fp32.

Above the optimizer: it wraps the model around an optimizer it is given (the stats reducers that
sit below the optimizer, for ZeRO and FSDP2, are ``ampfused._reducers``). :func:`data_parallel`
builds a stock DDP that leaves the fp32-accumulated params out and all-reduces their flat fp32
storage itself, once per synced backward. Why DDP cannot reduce them, the wire format, unused params
and which ranks join: docs/distributed.md ("DistributedDataParallel").
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import Tensor

__all__ = ["data_parallel"]


def data_parallel(module: torch.nn.Module, optimizer, **ddp_kwargs) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, **ddp_kwargs)`` for a ``FusedAmpAdamW`` with fp32-accumulated params.

    Build the optimizer on ``module.parameters()`` first, then wrap::

        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=3e-4, max_grad_norm=1.0)
        model = ampfused.distributed.data_parallel(model, opt, device_ids=[rank])

    The fp16/bf16 params whose gradients ``optimizer`` accumulates in fp32 are all-reduced in fp32
    by this wrapper (see the module note); every other param is DDP's as usual. ``ddp_kwargs`` go
    to DDP unchanged. The reduction is bound to this optimizer's gradient storage: train with this
    optimizer (a newer FusedAmpAdamW over the same params needs a new wrapper).
    """
    from .optim import FusedAmpAdamW

    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("data_parallel() takes the bare module: it builds the DistributedDataParallel itself")
    if not isinstance(optimizer, FusedAmpAdamW):
        raise TypeError(f"data_parallel() needs the FusedAmpAdamW over the module's params, got {type(optimizer).__name__}")
    main_grads = optimizer.main_grads
    ours = {id(p) for p in main_grads.params}
    names = [name for name, p in module.named_parameters() if id(p) in ours]
    if len(names) != len(ours):
        raise ValueError(
            f"{len(ours) - len(names)} params whose gradients the optimizer accumulates in fp32 are not params of this "
            "module: build the optimizer on module.parameters() (and wrap the same module)")
    already = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    mine, ignored = set(names), set(already)
    left = {n: p for n, p in module.named_parameters() if p.requires_grad and n not in mine}
    if names and not left:
        # DDP refuses a module with nothing left for its reducer: the same surface, without a reducer
        ddp = _Fp32DataParallel(module, **ddp_kwargs)
    else:
        if names:
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, already + names)
        ddp = torch.nn.parallel.DistributedDataParallel(module, **ddp_kwargs)
    if names:
        reduced_by_ddp = [] if isinstance(ddp, _Fp32DataParallel) else [p for n, p in left.items() if n not in ignored]
        _Fp32Reducer(ddp, main_grads, ddp_kwargs.get("process_group"), reduced_by_ddp)
    return ddp


# DDP arguments that only tune its reducer's buckets and graph bookkeeping: meaningless without one
_REDUCER_ONLY = {"device_ids", "output_device", "bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view",
                 "static_graph", "check_reduction", "dim"}


class _Fp32DataParallel(torch.nn.parallel.DistributedDataParallel):
    """What ``data_parallel`` returns when every trainable param is fp32-accumulated (DDP would refuse
    the module): ``.module``, ``forward``, ``no_sync()``, ``require_backward_grad_sync``, the state
    dict keys of DDP (``module.``-prefixed), rank 0's params and buffers at construction, and its
    buffers before every forward (``broadcast_buffers``, DDP's default).

    [note: a DDP without a reducer] It is a ``DistributedDataParallel`` that never runs DDP's
    constructor (which refuses a module with nothing left to reduce) and has no reducer: code that
    recognises DDP by ``isinstance`` treats it as one. That matters for checkpoints:
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` strips DDP's ``module.`` prefix, so a
    checkpoint taken through ``data_parallel`` has the keys of a DDP's and loads into an unwrapped, DDP or
    FSDP2 model. DDP's reducer-only methods (comm hooks, ``join``) are refused by name.
    """

    def __init__(self, module, process_group=None, broadcast_buffers=True, **kwargs):
        import torch.distributed as dist

        unknown = set(kwargs) - _REDUCER_ONLY
        if unknown:
            raise TypeError(f"data_parallel() got DistributedDataParallel arguments it cannot honour here: {sorted(unknown)}")
        torch.nn.Module.__init__(self)  # not DDP's: see [note: a DDP without a reducer]
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self._src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, self._src, group=process_group)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and torch.is_grad_enabled():
            import torch.distributed as dist

            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, self._src, group=self.process_group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # nn.Module's, not DDP's (which reach for the reducer and DDP's logger)
    train = torch.nn.Module.train
    __getstate__ = object.__getstate__
    __setstate__ = torch.nn.Module.__setstate__

    def _no_reducer(self, *args, **kwargs):
        raise RuntimeError(
            "this data_parallel module has no DistributedDataParallel reducer (every trainable param is "
            "fp32-accumulated and all-reduced by ampfused): comm hooks and join() have nothing to act on")

    register_comm_hook = join = _register_builtin_comm_hook = _no_reducer


class _Fp32Reducer:
    """All-reduces the optimizer's flat fp32 gradients once at the end of each synced backward.

    The all-reduce is queued (an autograd callback at the end of the
    backward, as DDP queues its own) by the first of two triggers: a gradient reaching the wrapped
    module's output, or one of the fp32-accumulated params (for a loss that reaches them outside the
    forward). A param hook alone is not enough: on a rank where none of those params gets a gradient
    (an MoE rank that routed nothing to the bf16 experts, a conditional branch) nothing would queue
    the collective, and the ranks that did would wait for it forever. ``ddp_params`` are the params
    DDP's own reducer all-reduces (empty without one): see :meth:`_warn_if_ddp_skips`.
    """

    def __init__(self, ddp, main_grads, group, ddp_params):
        self.main_grads = main_grads
        self.group = group
        self.ddp = ddp
        self.ddp_params = ddp_params
        self.sync = False  # latched at forward, as DDP decides at forward whether the backward syncs
        self.queued = False
        self.warned = False
        ddp.register_forward_pre_hook(self._latch)
        ddp.register_forward_hook(self._hook_outputs)
        for p in main_grads.params:  # after the optimizer's own hook: p.grad is main_grad by then
            p.register_post_accumulate_grad_hook(self._queue)
        ddp._ampfused_fp32_reducer = self  # lives as long as the DDP module
        main_grads.attach_reducer(self)  # the optimizer's hooks now know the fp32 gradients get all-reduced

    def _latch(self, ddp, args) -> None:
        self.sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync

    def _hook_outputs(self, ddp, args, output) -> None:
        if self.sync:
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(self._queue)

    def _queue(self, _) -> None:
        if self.sync and not self.queued:
            self._warn_if_ddp_skips()
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _warn_if_ddp_skips(self) -> None:
        """Warn (once) when this rank's synced backward reaches none of DDP's own trainable params.

        DDP's reducer starts its all-reduces from hooks on its
        params; a backward that reaches none of them joins nothing of DDP's on this rank. That is
        fine when every rank does so, and hangs the others when some rank's backward does reach them
        (stock DDP with ``find_unused_parameters=True`` hangs the same way): a collective mismatch only
        this rank can see, so it says so before it happens rather than refuse a pattern DDP allows.
        Asked of the engine (``_will_engine_execute_node``, what torch's ``register_multi_grad_hook``
        uses): in the usual backward the first param answers.
        """
        will_execute = getattr(torch._C, "_will_engine_execute_node", None)
        if self.warned or will_execute is None:
            return
        edge = torch.autograd.graph.get_gradient_edge
        trainable = [p for p in self.ddp_params if p.requires_grad]  # (a DDP whose params all froze joins nowhere)
        if trainable and not any(will_execute(edge(p).node) for p in trainable):
            self.warned = True
            warnings.warn(DDP_SKIPPED_MESSAGE, UserWarning, stacklevel=2)

    @torch.no_grad()
    def _reduce(self) -> None:
        """A param with no gradient on this rank in the synced backward (``p.grad``
        is not its ``main_grad``: autograd never reached it since the last clear) contributes zeros to the
        gradient all-reduce and 0 to a used-map, one fp32 flag per param summed over the ranks in a second,
        tiny all-reduce that overlaps the big one. Where the map says no rank used it, ``p.grad`` goes back
        to None and the step leaves the param alone (params, moments, step count), as DDP's
        ``find_unused_parameters=True`` leaves such a param's gradient untouched; where some rank used it,
        it gets the average like every other param. A gradient kept from an earlier step (cleared with
        ``set_to_none=False``) counts as used: DDP then steps it with zeros too."""
        import torch.distributed as dist

        self.queued = False
        self.sync = False
        flat = self.main_grads.flat
        params = self.main_grads.params
        used = torch.ones(len(params), dtype=torch.float32, device=flat.data.device)
        unused_here = [i for i, (p, view) in enumerate(zip(params, flat.views)) if p.grad is not view]
        for i in unused_here:  # zeros on the wire: every rank sends the same bytes
            flat.views[i].zero_()
        if unused_here:
            used[unused_here] = 0.0
        world = dist.get_world_size(self.group)
        grads = dist.all_reduce(flat.data, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        dist.all_reduce(used, op=dist.ReduceOp.SUM, group=self.group)
        grads.wait()
        flat.data.div_(world)
        if unused_here:
            # the host needs it to set p.grad to None; only rank-local unused
            # params can be unused everywhere, so the common case (every param used here) reads nothing
            used_anywhere = used[unused_here].tolist()
            for i, count in zip(unused_here, used_anywhere):
                params[i].grad = flat.views[i] if count else None


DDP_SKIPPED_MESSAGE = (
    "ampfused.distributed.data_parallel: this rank's synced backward reaches none of the params DistributedDataParallel "
    "reduces itself, so DDP's reducer joins no all-reduce on this rank. If another rank's backward does reach them, "
    "that rank waits for this one forever (stock DDP hangs the same way): make every rank's loss depend on the same "
    "DDP params in each synced backward (e.g. add 0 * the skipped branch's output)")
