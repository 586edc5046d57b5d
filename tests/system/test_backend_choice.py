"""Choosing a backend: bad names list the valid ones, an unavailable one says why, AMPFUSED_BACKEND
forces one, and a CUDA optimizer that falls back to the slow `reference` backend says so once per
process, naming the fix (resolving a backend for a CUDA device needs no GPU: only the probes' answers
matter)."""
import warnings

import pytest
import torch

import ampfused
from ampfused import _backends
from helpers import param


def fake_probes(monkeypatch, **reasons):
    probed = {name: (None, reason) for name, reason in reasons.items()}
    probed["reference"] = (_backends.importlib.import_module("ampfused.reference"), "")
    monkeypatch.setattr(_backends, "_probed", probed)
    monkeypatch.setattr(_backends, "_warned_reference_on_cuda", False)
    monkeypatch.delenv(_backends.ENV_VAR, raising=False)


def resolve_all(*requests):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = [_backends.resolve(r, torch.device("cuda"))[0].NAME for r in requests]
    return names, [w for w in caught if issubclass(w.category, _backends.SlowBackendWarning)]


def test_reference_fallback_on_cuda_warns_once_naming_the_fix(monkeypatch):
    fake_probes(monkeypatch, cuda="ampfused._C was built without CUDA kernels", triton="triton is not installed")
    names, caught = resolve_all(None, None, None)
    assert names == ["reference"] * 3
    assert len(caught) == 1
    message = str(caught[0].message)
    assert 'pip install "triton>=3.6"' in message and "AMPFUSED_BUILD_CUDA=1" in message
    assert "triton is not installed" in message  # why each fused backend was passed over


def test_no_warning_when_reference_is_asked_for_or_a_fused_backend_serves(monkeypatch):
    fake_probes(monkeypatch, cuda="not built", triton="triton is not installed")
    assert resolve_all("reference") == (["reference"], [])
    monkeypatch.setattr(_backends, "_probed", {**_backends._probed, "triton": (type("T", (), {"NAME": "triton"})(), "")})
    assert resolve_all(None) == (["triton"], [])


def test_cpu_tensors_on_reference_do_not_warn(monkeypatch):
    fake_probes(monkeypatch, cpu="the compiled extension is not available")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _backends.resolve(None, torch.device("cpu"))[0].NAME == "reference"
    assert not [w for w in caught if issubclass(w.category, _backends.SlowBackendWarning)]


def test_install_hints_are_quoted_and_numpy_is_named(monkeypatch):
    import importlib

    real_import_module = importlib.import_module

    def failing_triton(error_name):
        def import_module(name, *args, **kwargs):
            if name == "triton":  # the probe imports triton by name, even when it is already loaded
                raise ModuleNotFoundError(f"No module named '{error_name}'", name=error_name)
            return real_import_module(name, *args, **kwargs)
        return import_module

    monkeypatch.setattr(importlib, "import_module", failing_triton("numpy"))
    module, reason = _backends._probe_triton()
    assert module is None and "Triton needs numpy" in reason and "pip install numpy" in reason

    monkeypatch.setattr(importlib, "import_module", failing_triton("triton"))
    module, reason = _backends._probe_triton()
    assert module is None and reason.endswith('`pip install "triton>=3.6"`')


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


@pytest.mark.parametrize("requested", [None, "reference"])
def test_backend_reason_names_the_backend(monkeypatch, requested):
    monkeypatch.delenv(_backends.ENV_VAR, raising=False)
    p = param(3)
    opt = ampfused.FusedAmpAdamW([p], backend=requested)
    p.grad = torch.ones(3)
    opt.step()
    assert opt.backend_reason.startswith(f"{opt.backend}: "), opt.backend_reason
    assert ("requested" in opt.backend_reason) == (requested is not None)


def test_backend_reason_says_the_environment_variable_asked(monkeypatch):
    monkeypatch.setenv(_backends.ENV_VAR, "reference")
    opt = ampfused.FusedAmpAdamW([param(3)])
    assert opt.backend == "reference"
    assert opt.backend_reason == "reference: requested (through AMPFUSED_BACKEND)"


def test_cpu_only_torch_is_told_to_get_a_cuda_torch_not_to_rebuild(monkeypatch):
    """No ampfused rebuild gives CUDA kernels against a CPU-only torch: the advice says what can."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(_backends, "_probed", {})
    module, reason = _backends.probe("cuda")
    assert module is None
    assert "is not a CUDA build" in reason and "needs a CUDA build of torch" in reason, reason
    assert "AMPFUSED_BUILD_CUDA" not in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs an ampfused._C built without CUDA kernels")
def test_cuda_torch_without_ampfused_cuda_kernels_is_told_to_rebuild(monkeypatch):
    from ampfused import _compiled

    if _compiled.load()[0] is None:
        pytest.skip("ampfused._C is not built")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # as a CUDA torch on a machine whose build found no nvcc
    monkeypatch.setattr(_backends, "_probed", {})
    module, reason = _backends.probe("cuda")
    assert module is None and "AMPFUSED_BUILD_CUDA=1" in reason, reason
