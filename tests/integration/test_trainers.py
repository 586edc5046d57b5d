"""FusedAmpAdamW inside Hugging Face Trainer, PyTorch Lightning and Accelerate."""
import pytest
import torch

import ampfused


def changed(before, model):
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


def test_hf_trainer_tiny_gpt2(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (.ci/integration.sh installs it)")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(8)]
    before = [p.detach().clone() for p in model.parameters()]
    # clipping happens inside the step: Trainer's own clip_grad_norm_ is switched off
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, max_grad_norm=0.0, use_cpu=True,
                                          report_to=[], save_strategy="no", logging_steps=1, bf16=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    result = trainer.train()
    assert result.global_step == 4 and torch.isfinite(torch.tensor(result.training_loss))
    assert changed(before, model) and opt.state[next(model.parameters())]["step"].item() == 4
    assert torch.isfinite(opt.grad_norm)


def test_hf_trainer_optimizer_cls_and_kwargs(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(4)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                          max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizer_cls_and_kwargs=(ampfused.FusedAmpAdamW, {"lr": 1e-3, "max_grad_norm": 1.0}))
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer, ampfused.FusedAmpAdamW)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_configure_optimizers(tmp_path, precision):
    L = pytest.importorskip("lightning", reason="lightning is not installed (.ci/integration.sh installs it)")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            # Lightning refuses gradient_clip_val for optimizers that unscale inside step():
            # clip with max_grad_norm instead.
            return ampfused.FusedAmpAdamW(self.parameters(), lr=1e-2, max_grad_norm=1.0)

    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    module = Module()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=2, default_root_dir=str(tmp_path))
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    except (ValueError, RuntimeError) as exc:
        if precision == "16-mixed" and "cpu" in str(exc).lower():
            pytest.skip(f"Lightning refuses 16-mixed on CPU: {exc}")
        raise
    assert changed(before, module)
    opt = trainer.optimizers[0]
    opt = getattr(opt, "optimizer", opt)
    assert isinstance(opt, ampfused.FusedAmpAdamW) and torch.isfinite(opt.grad_norm)


def test_accelerate_prepare():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (.ci/integration.sh installs it)")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)  # HF Trainer above set up a process-wide state
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=2)
    model, opt, data = accelerator.prepare(model, opt, data)
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
    assert changed(before, model)
    inner = opt.optimizer
    assert isinstance(inner, ampfused.FusedAmpAdamW) and inner.state[next(model.parameters())]["step"].item() == 4


def test_hf_trainer_bf16_model_default_clipping_clips(tmp_path):
    """A bf16 model, default FusedAmpAdamW and Trainer's own clipping: its clip_grad_norm_ reads the
    fp32 p.grad, so it clips exactly like the fused max_grad_norm= (0.1 here, so that it engages)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (.ci/integration.sh installs it)")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(8)]
    runs = []
    for trainer_clips in (True, False):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=None if trainer_clips else 0.1)
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2, use_cpu=True, report_to=[],
                                              save_strategy="no", logging_steps=1, data_seed=0, seed=0,
                                              max_grad_norm=0.1 if trainer_clips else 0.0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        trainer.train()
        if trainer_clips:
            norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
            assert norms and all(n > 0.1 for n in norms), f"Trainer's clip must see the fp32 gradients: {norms}"
        runs.append([opt.state[p]["master_param"].clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
