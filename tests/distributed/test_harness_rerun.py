"""The spawn harness reruns a test once when a gloo rank aborts, and only then (dist_utils.run)."""
import os

import pytest
import torch.multiprocessing as mp

from dist_utils import requires_gloo, run

pytestmark = requires_gloo


def _abort_once(rank, world, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()


def _abort_always(rank, world):
    if rank == 1:
        os.abort()


def test_one_abort_reruns_with_the_ranks_stacks_in_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"(?s)rank 1 aborted; running the test again.*_abort_once"):
        run(_abort_once, 2, str(tmp_path / "aborted"), timeout=60)


def test_a_second_abort_fails():
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"), pytest.warns(RuntimeWarning, match="aborted"):
        run(_abort_always, 2, timeout=60)
