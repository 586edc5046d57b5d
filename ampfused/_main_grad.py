"""fp32 gradients for fp16/bf16 params: ``p.grad`` is a view of optimizer-owned flat fp32 storage.

With ``p.grad_dtype = None`` and ``p.grad`` pointed at the fp32 view ``p.main_grad``, autograd's own
AccumulateGrad adds later micro-batches in place; after a clear, the post-accumulate hook writes the
fresh low-precision gradient into the view and points ``p.grad`` back at it. CPU params also get the
C++ pre-hook of ``csrc/accumulate_hook.cpp``. Why this shape, and what it costs: docs/design.md §3.
We hold each CPU param's AccumulateGrad node, or the next forward would build a new one without the
hook.
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _compiled, _dtensor
from ._args import LOW_PRECISION, check_grad
from ._layout import is_dense
from ._state import FlatBuffer, uses_master

OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> weakref of the optimizer owning its main_grad
SUPPORTED = hasattr(torch.Tensor, "grad_dtype")
UNSUPPORTED_MESSAGE = (
    f"fp32_grad_accumulation needs Tensor.grad_dtype (torch >= 2.10) so that an fp16/bf16 param can hold its "
    f"fp32 gradient in p.grad; torch {torch.__version__} lacks it: upgrade torch, or pass "
    f"fp32_grad_accumulation=False (gradients are then read in the param dtype)")


def wanted(p: Tensor, fp32_grad_accumulation, master_weights) -> bool:
    """Whether the gradients of ``p`` accumulate in fp32 storage here, by the optimizer's two options."""
    if p.dtype not in LOW_PRECISION or _dtensor.is_dtensor(p):  # [distributed] FSDP2 owns DTensor grads
        return False
    if fp32_grad_accumulation is None:
        return uses_master(p, master_weights)
    return bool(fp32_grad_accumulation)


class MainGrads:
    """The flat fp32 gradients of one optimizer's fp16/bf16 params and the hooks that keep ``p.grad`` in them.

    A param carries ``p.main_grad`` (its view); ``OWNERS`` maps it to (a weak reference to) the
    optimizer that owns it: a newer optimizer over the same params takes them over, and the hooks of
    an older one then do nothing. The owner is not a param attribute:
    ``torch.save(model)`` pickles param attributes, and a weak reference does not pickle.

    Public through ``FusedAmpAdamW.main_grads`` (for ``ampfused.distributed`` and the benchmarks):
    ``params`` (the params whose gradients live here, in storage order), ``flat`` (a
    ``_state.FlatBuffer``: ``flat.data`` the whole fp32 buffer, ``flat.views[i]`` the gradient of
    ``params[i]``; ``None`` when no param needs one), :meth:`attach_reducer` and :meth:`has_cpu_hook`.
    """

    def __init__(self, owner: object, relayout):
        self.owner_ref = weakref.ref(owner)
        self.relayout = weakref.WeakMethod(relayout)  # the owner's: lays out every param that now needs a main_grad
        self.watched: set[int] = set()  # ids of params hooked while frozen (see watch)
        self.flat: FlatBuffer | None = None
        self.params: list[Tensor] = []
        self.hooks: list = []  # (param, handle, grad_dtype before we changed it)
        self.cpu_accumulators: dict = {}  # param -> (its AccumulateGrad node, the main_grad its C++ hook adds into)
        self.reducer = None  # what all-reduces the flat storage in a multi-process run (ampfused.distributed)
        self.warned = False
        self.ddp_reduced: set[int] = set()  # ids of params a plain DDP reduces in their own dtype (see fall_back_to_ddp)
        # the hooks and main_grad leave the params with the optimizer (the callback must not hold it)
        weakref.finalize(owner, _release, self.hooks, self.cpu_accumulators, self.owner_ref)

    def attach_reducer(self, reducer) -> None:
        """Say that ``reducer`` all-reduces this storage in a multi-process run (so the hooks do not warn)."""
        self.reducer = reducer

    def has_cpu_hook(self, p: Tensor) -> bool:
        """Whether micro-batches 2..N of ``p`` are added by the C++ hook on its AccumulateGrad node."""
        return p in self.cpu_accumulators

    def owns(self, p: Tensor) -> bool:
        return OWNERS.get(p) is self.owner_ref

    def sync(self, candidates: list[Tensor], device: torch.device) -> None:
        """Lay out storage for every param of ``candidates`` (those :func:`wanted`) that trains.

        A param frozen after it was laid out keeps its storage (it may be unfrozen again); one frozen
        before gets none until its first gradient (:meth:`watch`).
        """
        if candidates and not SUPPORTED:
            raise RuntimeError(UNSUPPORTED_MESSAGE)
        if candidates and device.type == "cpu":
            _compiled.load()  # registers the C++ accumulation hook op where _C is built
        self.setup([p for p in candidates if p.requires_grad or self.owns(p)], device)
        self.watch([p for p in candidates if not p.requires_grad])  # (skips the laid-out ones)

    def setup(self, params: list[Tensor], device: torch.device) -> None:
        """(Re)lay out the flat storage for ``params`` and hook the ones not hooked yet.

        A gradient a param already holds (accumulated here before a re-layout, by another optimizer
        that owned the param, or by a backward before this optimizer was built) moves into the new
        storage, so it keeps accumulating in fp32.
        """
        params = [p for p in params if id(p) not in self.ddp_reduced]
        self.flat = FlatBuffer(params, device) if params else None
        self.params = params
        cpu_hook = device is not None and device.type == "cpu" and hasattr(torch.ops.ampfused, "_hook_accumulation")
        for p, view in zip(params, self.flat.views if params else ()):
            if not self.owns(p):
                before = p.dtype if p in OWNERS else p.grad_dtype
                p.grad_dtype = None  # p.grad may now be fp32 (see the module note)
                if id(p) not in self.watched:
                    self.hooks.append((p, p.register_post_accumulate_grad_hook(_adopt_hook(self)), before))
            grad = p.grad
            if grad is not None and not grad.is_sparse and grad.shape == p.shape and grad.device == p.device:
                view.copy_(grad)
                p.grad = view
            p.main_grad = view
            OWNERS[p] = self.owner_ref
            if cpu_hook:  # (the op exists once the optimizer loaded _C)
                self._hook_cpu_accumulation(p, view)

    def _hook_cpu_accumulation(self, p: Tensor, view: Tensor) -> None:
        """(Re)point the C++ accumulation hook of ``p`` at ``view`` (see the module note)."""
        old = self.cpu_accumulators.pop(p, None)
        if old is not None:
            torch.ops.ampfused._unhook_accumulation(p, old[1])
            node = old[0]
        elif p.requires_grad:
            node = torch.autograd.graph.get_gradient_edge(p).node  # held first: the op hooks the live node
        else:
            return  # frozen and never hooked: it is laid out (and hooked) again when it is unfrozen
        torch.ops.ampfused._hook_accumulation(p, view)
        self.cpu_accumulators[p] = (node, view)

    def watch(self, frozen: list[Tensor]) -> None:
        """Hook frozen params too, without storage: one unfrozen later (``requires_grad_(True)``) is laid
        out by its hook at its first gradient, so its next micro-batches accumulate in fp32 (gradual
        unfreezing). A hook can only be registered while the param requires grad, and it stays."""
        for p in frozen:
            if id(p) in self.watched or self.owns(p) or id(p) in self.ddp_reduced:
                continue
            p.requires_grad_(True)
            try:
                handle = p.register_post_accumulate_grad_hook(_adopt_hook(self))
            finally:
                p.requires_grad_(False)
            self.hooks.append((p, handle, p.grad_dtype))
            self.watched.add(id(p))

    def fall_back_to_ddp(self) -> bool:
        """Once per optimizer, at the first fp32 adoption in a multi-process run that ampfused does not
        reduce: hand the params a plain ``DistributedDataParallel`` reduces back to it. True when any was.

        DDP's buckets have the param dtype and reject an fp32 ``p.grad`` ("Expected
        BFloat16, got Float"), and a comm hook only sees the bucket. So a param DDP's reducer owns runs with
        ``fp32_grad_accumulation`` off: its gradient stays in the param dtype, as DDP (and stock AdamW)
        expect -- accumulated by autograd, under ``no_sync()`` too, all-reduced in that dtype, a bucket view
        with ``gradient_as_bucket_view`` -- and the step reads it directly (fp32 masters and moments still).
        DDP marks nothing on its params, so the DDP modules alive then are found once through the garbage
        collector (one scan per optimizer, at its first backward); a DDP built after that first backward is
        not seen, and then fails as before, with the warning. ``ampfused.distributed.data_parallel`` keeps
        fp32 accumulation through the all-reduce instead.
        """
        import gc

        ddp_type = torch.nn.parallel.DistributedDataParallel
        mine = {id(p) for p in self.params}
        reduced = set()
        for obj in gc.get_objects():
            if isinstance(obj, ddp_type) and getattr(obj, "reducer", None) is not None:
                reduced.update(id(p) for p in getattr(obj, "_module_parameters", ()) if id(p) in mine)
        if not reduced:
            return False
        self.ddp_reduced |= reduced
        for p in [p for p in self.params if id(p) in reduced]:
            old = self.cpu_accumulators.pop(p, None)
            if old is not None:
                torch.ops.ampfused._unhook_accumulation(p, old[1])
            if p.grad is not None and p.grad is p.main_grad:  # accumulated before the DDP existed
                p.grad = p.main_grad.to(p.dtype)
            del p.main_grad, OWNERS[p]
        if self.flat is not None:
            self.setup([p for p in self.params if id(p) not in reduced], self.flat.data.device)
        warnings.warn(DDP_FALLBACK_MESSAGE.format(count=len(reduced)), UserWarning, stacklevel=3)
        return True

    def relayout_if_strides_changed(self) -> None:
        """A param whose memory format changed after construction (``model.to(memory_format=...)``) gets matching views."""
        # (a param with gaps keeps contiguous views whatever its strides: [note: non-dense params] in _args)
        if self.flat is not None and any(v.stride() != p.stride() and is_dense(p) for p, v in zip(self.params, self.flat.views)):
            self.setup(self.params, self.flat.data.device)


def adopt(p: Tensor) -> None:
    """Write a fresh gradient of ``p`` into ``p.main_grad`` and make that ``p.grad`` (see the module note)."""
    grad = p.grad
    check_grad(p, grad)
    main = p.main_grad
    main.copy_(grad)
    p.grad = main


def _adopt_hook(grads: MainGrads):
    # the hook holds the MainGrads, which holds its optimizer only weakly: the
    # optimizer can die, and its finalizer removes the hooks (and so the flat storage with them).
    def hook(p: Tensor) -> None:
        # the common path (micro-batch 2..N: autograd added into main_grad itself) is one identity test
        grad = p.grad
        if grad is not None and grad is not getattr(p, "main_grad", None) and OWNERS.get(p) is grads.owner_ref:
            if grads.reducer is None and not grads.warned and _multi_process():
                grads.warned = True
                if grads.fall_back_to_ddp() and id(p) in grads.ddp_reduced:
                    return  # p.grad stays in the param dtype, for DDP's reducer
                # a warning, not an error: a per-rank optimizer that is not meant to be reduced is legitimate
                if not grads.ddp_reduced:
                    warnings.warn(UNREDUCED_MESSAGE, UserWarning, stacklevel=2)
            if p.main_grad.stride() != p.stride() and is_dense(p):
                # the model changed memory format (model.to(memory_format=...)) since the
                # layout: the storage follows now, at the first gradient, not at step(), or autograd warns that
                # grad and param break the layout contract on the next micro-batches. setup() adopts p.grad.
                grads.relayout_if_strides_changed()
                return
            adopt(p)
        elif grad is not None and id(p) in grads.watched and p not in OWNERS and id(p) not in grads.ddp_reduced:  # frozen at layout, trainable now
            relayout = grads.relayout()
            if relayout is not None:
                relayout()  # lays p out and moves this first gradient into its main_grad

    return hook


UNREDUCED_MESSAGE = (
    "FusedAmpAdamW accumulates fp16/bf16 gradients in fp32, and in this multi-process run nothing of ampfused "
    "all-reduces them. If the model is wrapped in DistributedDataParallel, its buckets have the param dtype and reject an fp32 gradient "
    "('Expected BFloat16, got Float'). Wrap the model with ampfused.distributed.data_parallel(model, opt) instead of "
    "DistributedDataParallel(model) (it all-reduces the fp32 gradients, 4 B/param), or build the optimizer with "
    "fp32_grad_accumulation=False (DDP reduces the fp16/bf16 gradients, 2 B/param)")


DDP_FALLBACK_MESSAGE = (
    "FusedAmpAdamW: {count} fp16/bf16 params are reduced by DistributedDataParallel, whose buckets have the param dtype: "
    "their gradients are accumulated and all-reduced in that dtype (as with torch.optim.AdamW) and the step reads them "
    "directly (fp32_grad_accumulation is off for them). For fp32 accumulation through the all-reduce, wrap the model "
    "with ampfused.distributed.data_parallel(model, opt) instead of DistributedDataParallel(model)")


def _multi_process() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _release(hooks: list, cpu_accumulators: dict, owner_ref) -> None:
    """Finalizer: remove the hooks, and main_grad and grad_dtype where no newer optimizer owns the param."""
    for p, (_, view) in cpu_accumulators.items():
        torch.ops.ampfused._unhook_accumulation(p, view)
    cpu_accumulators.clear()
    for p, handle, grad_dtype in hooks:
        handle.remove()
        if OWNERS.get(p) is owner_ref:
            del p.main_grad, OWNERS[p]
            if p.grad is None or p.grad.dtype == grad_dtype:
                p.grad_dtype = grad_dtype
    hooks.clear()
