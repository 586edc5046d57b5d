"""Every backend's passes take the contract's arguments, and the kernels' layout checks answer as the
contract's. (The shared numbers and records have one definition, ampfused/_contract.py, which the
C++ and Triton spellings are generated from: test_contract_generated.py.)
"""
import inspect

import pytest
import torch

from ampfused import _backends, _batch, _contract, _layout, functional, reference
from ampfused._compiled import CompiledBackend


def test_hyper_flags():
    assert _batch.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True).flags == _contract.FLAG_AMSGRAD | _contract.FLAG_MAXIMIZE
    assert _batch.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, True).flags == _contract.FLAG_MAXIMIZE
    assert _batch.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False).flags == 0


def test_lr_kind_classifies_each_lr_once():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object: nothing runs on it
    assert _batch.lr_kind(1e-3, cpu) == _batch.lr_kind(1e-3, gpu) == _contract.LR_VALUE
    assert _batch.lr_kind(torch.tensor(1e-3), gpu) == _contract.LR_VALUE  # host memory, a step off the CPU: read on the host
    for dtype, kind in _contract.LR_KIND_OF_DTYPE.items():
        assert _batch.lr_kind(torch.tensor(1e-3, dtype=dtype), cpu) == kind  # read in its own dtype at kernel time
    assert _batch.lr_kind(torch.tensor(1, dtype=torch.int32), cpu) == _contract.LR_F32  # read through a float32 copy
    assert _batch.lr_kind(torch.tensor([1e-3], device="meta"), cpu) == _contract.LR_F32  # another device: a copy
    with pytest.raises(ValueError, match="1-element"):
        _batch.lr_kind(torch.tensor([1e-3, 1e-3]), cpu)


def test_batch_classifies_its_lrs_with_its_groups():
    p = torch.zeros(3)
    rows = [_batch.Hyper(lr, 0.9, 0.999, 1e-8, 0.0, False, False)
            for lr in (1e-3, torch.tensor(1e-3, dtype=torch.float64), torch.tensor(1e-3, dtype=torch.bfloat16))]
    batch = _batch.Batch([p], [p], [p], [p], [None], [torch.zeros(())], [None], [0], rows)
    assert batch.lr_kinds == [_contract.LR_VALUE, _contract.LR_F64, _contract.LR_BF16]
    batch.groups = rows[:1]  # a step patches its group rows: the kinds follow
    assert batch.lr_kinds == [_contract.LR_VALUE]


def layout_table():
    """(name, tensor) pairs covering the layouts a param, grad or state tensor can have."""
    base = torch.randn(4, 6, 5, 3)
    return [
        ("contiguous", torch.randn(4, 6)),
        ("transposed", torch.randn(4, 6).t()),
        ("channels_last", base.to(memory_format=torch.channels_last)),
        ("permuted", base.permute(2, 0, 3, 1)),
        ("strided slice", torch.randn(4, 6)[:, ::2]),
        ("row slice", torch.randn(4, 6)[1:3]),
        ("column slice", torch.randn(4, 6)[:, 1:4]),
        ("expanded", torch.randn(4, 1).expand(4, 6)),
        ("overlapping", torch.randn(8).as_strided((3, 4), (2, 1))),
        ("size-1 dims, odd strides", torch.randn(6).as_strided((1, 6, 1), (99, 1, 7))),
        ("0-d", torch.tensor(1.5)),
        ("0-d view", torch.randn(3)[1]),
        ("empty", torch.empty(0, 3)),
        ("empty, odd strides", torch.empty(0, 3).as_strided((0, 3), (1, 5))),
        ("one element", torch.randn(1, 1).as_strided((1, 1), (3, 5))),
    ]


def test_kernel_layout_checks_equal_the_contract():
    """``_tables.dense`` / ``same_flat_layout`` are the kernels' copies of the contract's (the kernels
    import nothing of the package); they must answer alike on every layout."""
    pytest.importorskip("triton", reason="the Triton kernels' copies need triton to import")
    from ampfused.kernels import _tables

    table = layout_table()
    expected_dense = {"contiguous", "transposed", "channels_last", "permuted", "row slice",
                      "size-1 dims, odd strides", "0-d", "0-d view", "empty", "empty, odd strides", "one element"}
    assert {name for name, t in table if _layout.is_dense(t)} == expected_dense
    for name, t in table:
        assert _tables.dense(t) == _layout.is_dense(t), name
        for other_name, other in table:
            assert _tables.same_flat_layout(t, other) == _layout.same_flat_layout(t, other), (name, other_name)


def test_python_modules_use_the_contract_itself():
    assert functional.Hyper is _batch.Hyper and functional.STATS_SIZE == _contract.STATS_SIZE
    assert reference.finish_ is _contract.finish_
    assert functional.Scratch().buffer(torch.device("cpu")).numel() == _contract.SCRATCH_BYTES


def backends_to_check():
    out = [("reference", reference), ("compiled", CompiledBackend("cpu", None))]
    try:
        from ampfused import kernels  # (imports triton)
    except ImportError:  # the compiled and reference backends are still checked
        return out
    return out + [("triton", kernels)]


@pytest.mark.parametrize("name,backend", backends_to_check(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("method", ["accumulate_", "grad_stats_", "adamw_update_", "scaler_update_"])
def test_every_backend_takes_the_contracts_arguments(name, backend, method):
    want = [p for p in inspect.signature(getattr(_backends.Backend, method)).parameters.values() if p.name != "self"]
    got = list(inspect.signature(getattr(backend, method)).parameters.values())
    assert [(p.name, p.kind) for p in got] == [(p.name, p.kind) for p in want], f"{name}.{method}"
    assert isinstance(backend.NAME, str) and callable(backend.supports)
