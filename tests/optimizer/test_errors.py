"""Bad input gets a clear error naming the problem, and nothing is half-applied."""
import pytest
import torch

import ampfused
from ampfused import _backends


def param(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(*shape).to(dtype))


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr"), (dict(eps=-1e-8), "eps"), (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]"), (dict(betas=(0.9,)), "betas"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), "lr"), (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm"), (dict(differentiable=True), "differentiable"),
])
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ampfused.FusedAmpAdamW([param(3)], **kwargs)


def test_invalid_group_hyperparameters():
    with pytest.raises(ValueError, match="lr"):
        ampfused.FusedAmpAdamW([{"params": [param(3)]}, {"params": [param(2)], "lr": -1.0}])


def test_empty_params():
    with pytest.raises(ValueError, match="empty"):
        ampfused.FusedAmpAdamW([])


def test_unsupported_dtype():  # (float64 and complex params train: tests/optimizer/test_wide_params.py)
    with pytest.raises(ValueError, match="torch.int32 is not supported"):
        ampfused.FusedAmpAdamW([torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(ValueError, match="torch.complex32 is not supported"):
        ampfused.FusedAmpAdamW([torch.zeros(3, dtype=torch.complex32)])


def test_params_with_gaps_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="gaps or overlaps"):
        ampfused.FusedAmpAdamW([torch.nn.Parameter(torch.randn(4, 12))[:, ::2]])
    with pytest.raises(ValueError, match="gaps or overlaps"):
        ampfused.FusedAmpAdamW([torch.randn(1, 6).expand(4, 6).requires_grad_()])


def test_sparse_gradients_raise_and_change_nothing(backend):
    a, b = param(5, 3), param(5, 3)
    opt = ampfused.FusedAmpAdamW([a, b], backend=backend)
    a.grad = torch.ones_like(a)
    b.grad = torch.ones_like(b).to_sparse()
    before = a.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(a, before) and not any(opt.state.values())


def test_wrong_gradient_shape(backend):
    a = param(4)
    opt = ampfused.FusedAmpAdamW([a], backend=backend)
    a.grad = torch.ones(4)
    a.grad.data = torch.ones(5)  # sneaks past autograd's own shape check
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()


def test_dtype_changed_after_construction(backend):
    model = torch.nn.Linear(3, 3)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    model.half()
    model(torch.randn(2, 3, dtype=torch.half)).sum().backward()
    with pytest.raises(RuntimeError, match="after the optimizer was built"):
        opt.step()


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="'reference'"):
        ampfused.FusedAmpAdamW([param(3)], backend="tpu")


def test_unavailable_backend_says_why(monkeypatch):
    monkeypatch.setitem(_backends._probed, "cuda", (None, "no CUDA device in this test"))
    opt = ampfused.FusedAmpAdamW([param(3)], backend="cuda")
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="no CUDA device in this test"):
        opt.step()


def test_environment_variable_forces_a_backend(monkeypatch):
    monkeypatch.setenv("AMPFUSED_BACKEND", "reference")
    p = param(3)
    opt = ampfused.FusedAmpAdamW([p])
    assert opt.backend == "reference" and "requested" in opt.backend_reason
    monkeypatch.setenv("AMPFUSED_BACKEND", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        ampfused.FusedAmpAdamW([p]).backend
