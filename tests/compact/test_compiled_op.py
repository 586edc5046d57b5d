"""The compiled ``ampfused::adamw_update`` op with compact state keeps its registration honest
(schema, fake tensors, AOT dispatch: what torch.compile relies on)."""
import pytest
import torch

from helpers import update_lists


@pytest.mark.parametrize("test_utils", ["test_schema", "test_faketensor", "test_aot_dispatch_dynamic"])
@pytest.mark.parametrize("kernel", ["cpu", "cuda"], indirect=True)
def test_opcheck_with_compact_state_and_a_seed(kernel, test_utils):
    """int16/int8 masters, bf16 and int8 moments (with their scales) and rounding_seed."""
    entries = [kernel.entry(n, dt, mw, sd, amsgrad=True, seed=3) for n, dt, mw, sd in
               [(700, torch.bfloat16, "split16", torch.bfloat16), (700, torch.float16, "split8", torch.float32),
                (4500, torch.bfloat16, "split8", "int8")]]
    lists = update_lists(entries)
    empty = torch.empty(0, device=kernel.device)
    scales = [t if t is not None else empty for s in lists["moment_scales"] for t in (s or (None,) * 3)]
    args = (lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"], lists["max_exp_avg_sqs"],
            lists["steps"], lists["masters"], [0, 0, 0], [1e-3], [None], [0.9], [0.999], [1e-8], [0.01], [1],
            torch.tensor([0.0, 0.0, 1.0, 0.0], device=kernel.device), None, None, 77, scales)
    torch.library.opcheck(torch.ops.ampfused.adamw_update.default, args, test_utils=test_utils)
