"""Stats reducers: the all-reduce that turns one rank's sum of squares and skip flag into the global ones.

Below the optimizer: ``functional.run_step`` calls a reducer between the stats pass and the finish
(``reduce_stats(sumsq, flag) -> (sumsq, flag)``), so every rank clips by the same norm and takes
the same skip decision. Two callers build one:

* ``_dtensor`` for DTensor (FSDP2) params: a :class:`MeshReducer` over every sharded mesh dimension;
* ``FusedAmpAdamW`` as one partition of a ``ZeroRedundancyOptimizer``: a :class:`MeshReducer` over
  ZeRO's process group (:func:`partition_reducer`).

Nothing here imports ``torch.distributed`` before a reducer runs.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor


ZERO_FP32_MESSAGE = (
    "ZeroRedundancyOptimizer(optimizer_class=FusedAmpAdamW) with fp16/bf16 params and fp32 gradient accumulation "
    "is not supported: DDP all-reduces the gradients in the param dtype and cannot take the fp32 p.grad of a "
    "partition; pass fp32_grad_accumulation=False (master weights stay fp32), or use fp32 params under autocast")


class MeshReducer:
    """All-reduce (SUM) of the 0-d sum of squares and the inf flag: one collective per process group.

    Always two fp32 elements, whatever the caller's ``found_inf`` (tensor, number or None), so a
    rank with nothing to step can join with zeros (:meth:`join`).
    """

    def __init__(self, groups: list):
        self.groups = groups

    def __call__(self, sumsq: Tensor, found_inf: Tensor | None) -> tuple[Tensor, Tensor]:
        if isinstance(found_inf, Tensor):
            flag = found_inf.to(device=sumsq.device, dtype=torch.float32).reshape(-1).sum()
        else:  # a number from the host (or None): no device read
            flag = torch.full((), float(bool(found_inf)), dtype=torch.float32, device=sumsq.device)
        packed = torch.stack([sumsq.reshape(()), flag])
        self._all_reduce(packed)
        return packed[0], packed[1]

    def join(self, device: torch.device | None) -> None:
        """Take part in the collective with zeros (a rank whose optimizer has no gradient this step)."""
        import torch.distributed as dist

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.groups[0]) == "nccl" else torch.device("cpu")
        self._all_reduce(torch.zeros(2, dtype=torch.float32, device=device))

    def _all_reduce(self, packed: Tensor) -> None:
        import torch.distributed as dist

        for group in self.groups:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)


def partition_reducer(partition_group=None, max_frames: int = 6) -> MeshReducer | None:
    """The reducer of an optimizer that steps one partition of the params, or None.

    [note: ZeRO] ``ZeroRedundancyOptimizer(params, optimizer_class=FusedAmpAdamW)`` builds one
    FusedAmpAdamW per rank over that rank's partition, with the user's keyword arguments. The
    clip norm and the skip decision must cover every partition, so such an optimizer all-reduces
    its sum of squares over ZeRO's group (the partitions are disjoint: the sum is the global one).
    The explicit way is ``FusedAmpAdamW(..., partition_group=group)`` (ZeRO forwards it); without
    it, the ZeroRedundancyOptimizer constructing the caller is found on the stack as a fallback,
    since ZeRO passes nothing that says so and torch has no hook for it.
    """
    if partition_group is not None:
        return MeshReducer([partition_group])
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if module is None:
        return None
    frame = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, module.ZeroRedundancyOptimizer):
            return MeshReducer([candidate.process_group])
        frame = frame.f_back
    return None
