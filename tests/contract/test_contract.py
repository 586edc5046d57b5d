"""One spelling per constant: the kernels' copies of the pass contract equal ``ampfused._contract``,
and every backend's passes take the contract's arguments.

``ampfused.kernels`` imports nothing of the package (it is a backend found by name), so it keeps
its own copies of the stats slots, flags, dtype codes and scratch size; this is what holds them equal.
"""
import inspect

import pytest
import torch

from ampfused import _contract, functional, reference
from ampfused._compiled import CompiledBackend


def value(x):
    return getattr(x, "value", x)  # a Triton tl.constexpr holds its number in .value


def test_contract_numbers():
    slots = (_contract.NORM, _contract.SKIP, _contract.FACTOR, _contract.SUMSQ)
    assert sorted(slots) == list(range(_contract.STATS_SIZE))
    assert (_contract.FLAG_AMSGRAD, _contract.FLAG_MAXIMIZE) == (1, 2)
    assert _contract.DTYPE_CODE == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    assert _contract.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True).flags == 3
    assert _contract.Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, True).flags == _contract.FLAG_MAXIMIZE


def test_kernel_copies_equal_the_contract():
    pytest.importorskip("triton", reason="the Triton kernels' copies need triton to import")
    from ampfused.kernels import _tables, adamw, stats

    assert [value(x) for x in (stats.NORM, stats.SKIP, stats.FACTOR, stats.SUMSQ)] == \
        [_contract.NORM, _contract.SKIP, _contract.FACTOR, _contract.SUMSQ]
    assert value(stats.CLIP_EPS) == _contract.CLIP_EPS
    assert [value(adamw.SKIP), value(adamw.FACTOR)] == [_contract.SKIP, _contract.FACTOR]
    assert [value(adamw.AMSGRAD), value(adamw.MAXIMIZE)] == [_contract.FLAG_AMSGRAD, _contract.FLAG_MAXIMIZE]
    assert _tables.DTYPE_CODE == _contract.DTYPE_CODE
    assert _tables.SCRATCH_BYTES == _contract.SCRATCH_BYTES


def test_python_modules_use_the_contract_itself():
    assert functional.Hyper is _contract.Hyper and functional.STATS_SIZE == _contract.STATS_SIZE
    assert reference.finish_ is _contract.finish_
    assert functional.Scratch().buffer(torch.device("cpu")).numel() == _contract.SCRATCH_BYTES


def backends_to_check():
    out = [("reference", reference), ("compiled", CompiledBackend("cpu", None))]
    try:
        import triton  # noqa: F401
        from ampfused import kernels
    except ImportError:  # the compiled and reference backends are still checked
        return out
    return out + [("triton", kernels)]


@pytest.mark.parametrize("name,backend", backends_to_check(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("method", ["accumulate_", "grad_stats_", "adamw_update_", "scaler_update_"])
def test_every_backend_takes_the_contracts_arguments(name, backend, method):
    want = [p for p in inspect.signature(getattr(_contract.Backend, method)).parameters.values() if p.name != "self"]
    got = list(inspect.signature(getattr(backend, method)).parameters.values())
    assert [(p.name, p.kind) for p in got] == [(p.name, p.kind) for p in want], f"{name}.{method}"
    assert isinstance(backend.NAME, str) and callable(backend.supports)
