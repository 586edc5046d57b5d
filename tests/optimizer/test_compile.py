"""torch.compile: a compiled model trains with FusedAmpAdamW exactly like the eager one
(fp32, and bf16 params whose gradients reach p.main_grad through the accumulation hook), and a
compiled opt.step() runs (dynamo graph-breaks around the backend call) with the eager result.

Inductor on a 2-core CPU spends ~50 s compiling C++ for even a tiny model,
so these default tests use the "aot_eager" backend (dynamo + AOTAutograd, the parts that interact with
hooks and the optimizer); tests/integration/test_compile_inductor.py runs the same with inductor."""
import pytest
import torch

import ampfused
from helpers import mlp

COMPILE_BACKEND = "aot_eager"


def small_model(dtype):
    return mlp(8, 16, 4, activation=torch.nn.GELU, dtype=dtype)


def train_compiled(dtype, backend, compile_model=False, compile_step=False, compiler=COMPILE_BACKEND, steps=3):
    torch._dynamo.reset()
    model = small_model(dtype)
    forward = torch.compile(model, backend=compiler) if compile_model else model
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0**4)
    step = torch.compile(opt.step, backend=compiler) if compile_step else opt.step
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _micro in range(2):
            x = torch.randn(4, 8, generator=g).to(dtype)
            scaler.scale(forward(x).float().square().mean()).backward()
        if compile_step:
            scaler.unscale_(opt)
            step()
        else:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_model_trains_like_eager(backend, dtype):
    eager, eager_opt = train_compiled(dtype, backend)
    compiled, opt = train_compiled(dtype, backend, compile_model=True)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        assert opt.state[q]["step"].item() == 3
        if dtype == torch.bfloat16:
            assert q.grad is None and hasattr(q, "main_grad"), "the accumulation hook must still fold the grads"


def test_compiled_optimizer_step_matches_eager(backend):
    eager, _ = train_compiled(torch.float32, backend)
    compiled, opt = train_compiled(torch.float32, backend, compile_step=True)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(opt.grad_norm)
