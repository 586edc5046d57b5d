"""The distributed checks of test_fsdp2, test_distributed and test_dcp on GPUs with NCCL (one GPU per
rank, every backend that serves CUDA tensors). Needs at least 2 CUDA GPUs."""
import pytest
import torch

import test_dcp
import test_distributed
import test_fsdp2
from dist_utils import run

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 CUDA GPUs for NCCL (this machine has {GPUS})"),
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
                       reason="this torch is built without NCCL"),
]


def test_fsdp2_nccl():
    run(test_fsdp2._worker, 2, timeout=300, backend="nccl")


def test_ddp_and_zero_nccl():
    run(test_distributed._worker, 2, timeout=300, backend="nccl")


def test_dcp_round_trip_nccl(tmp_path):
    run(test_dcp._save_worker, 2, str(tmp_path), timeout=300, backend="nccl")
    if GPUS >= 4:
        run(test_dcp._load_worker, 4, str(tmp_path), timeout=300, backend="nccl")
