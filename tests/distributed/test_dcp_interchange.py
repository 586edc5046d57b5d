"""DCP checkpoints of bf16 models between torch.optim.AdamW and FusedAmpAdamW in every mode (issue 34).

- A stock AdamW checkpoint of a bf16 FSDP2 model loads into FusedAmpAdamW in every mode through
  ``ampfused.checkpoint.dcp_load`` (plain ``dcp.load`` cannot: it asks for the loader's keys), and
  gives exactly what the in-memory ``set_optimizer_state_dict`` of the stock state gives: params and
  every state tensor, bitwise, and the same next step. The reverse: a FusedAmpAdamW checkpoint of
  every mode loads into stock AdamW with its moments decoded to fp32 (as ``to_torch_state_dict``
  gives) and the saved params.
- A master a stock AdamW carried along (bf16, stale) in a DCP checkpoint is never taken.
- A checkpoint taken through ``ampfused.distributed.data_parallel`` on an all-bf16 model has a DDP's
  keys and loads into an unwrapped, a DDP and an FSDP2 model.

2 gloo ranks; the model's large layer (81 x 66) is sharded 41 / 40 rows, not multiples of 256 elements.
"""
import warnings

import pytest
import torch

import ampfused
from ampfused import _compact
from dist_utils import rank_batch, rank_device, requires_gloo, run
from helpers import bits, mlp
from test_fsdp2 import local
from test_dcp import kernel_backend

pytestmark = requires_gloo
HYPER = dict(lr=1e-2, weight_decay=0.1)
MASTERS = (None, "split16", "split8", False)  # fp32 (the default), split16, split8, none


def interchange_bf16_model():
    # the same init on every rank; 81 x 66 = 5,346 elements, rows of 66: int8 / int4 moments apply to it (4,096 and up)
    return mlp(6, 66, 81, 3, dtype=torch.bfloat16, device=rank_device())


def sharded(model):
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model


def train_sharded(model, opt, rank, steps, first=0):
    for step in range(first, first + steps):
        x, y = rank_batch(1000 * step + rank, 4)
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()


def fused(model, master_weights, state_dtype):
    return ampfused.FusedAmpAdamW(model.parameters(), **HYPER, master_weights=master_weights, state_dtype=state_dtype,
                                  backend=kernel_backend())




def assert_same(model_a, opt_a, model_b, opt_b, what):
    """Params and every state tensor of ``opt_a`` and ``opt_b`` (same class and mode), local shards, bitwise."""
    opt_a.state_dict(), opt_b.state_dict()  # masters a load left to the params are taken by now at the latest
    for i, (p, q) in enumerate(zip(model_a.parameters(), model_b.parameters())):
        assert torch.equal(bits(p), bits(q)), f"{what}: param {i}"
        a, b = opt_a.state[p], opt_b.state[q]
        assert a.keys() == b.keys(), f"{what}: state keys of param {i}: {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert torch.equal(bits(a[key]), bits(b[key])), f"{what}: {key} of param {i}"


def save_dcp(root, model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)


def load_with(loader, root, model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    loader({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def stock_into_every_master_mode(rank, root, state_dtype):
    """A stock checkpoint -> FusedAmpAdamW(mode) through dcp_load == the in-memory load of the stock state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict

    stock_model = sharded(interchange_bf16_model())
    stock = torch.optim.AdamW(stock_model.parameters(), **HYPER)
    train_sharded(stock_model, stock, rank, 2)
    save_dcp(f"{root}/stock", stock_model, stock)
    for master_weights in MASTERS:
        what = f"stock -> master_weights={master_weights} state_dtype={state_dtype}"
        expected_model = sharded(interchange_bf16_model())
        expected = fused(expected_model, master_weights, state_dtype)
        set_state_dict(expected_model, expected, model_state_dict=get_model_state_dict(stock_model),
                       optim_state_dict=get_optimizer_state_dict(stock_model, stock))
        model = sharded(interchange_bf16_model())
        opt = fused(model, master_weights, state_dtype)
        if master_weights is None:  # why dcp_load exists: DCP asks the checkpoint for the loader's keys
            with pytest.raises(CheckpointException) as refused:
                load_with(dcp.load, f"{root}/stock", model, opt)
            assert "Missing key in checkpoint state_dict: optim.state.0.weight.master_param" in str(refused.value.failures)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a stock checkpoint holds no master: nothing to warn about
            load_with(ampfused.checkpoint.dcp_load, f"{root}/stock", model, opt)
        assert_same(expected_model, expected, model, opt, what)
        for p, q in zip(model.parameters(), stock_model.parameters()):
            assert torch.equal(bits(p), bits(q)), f"{what}: the params are the saved ones"
        train_sharded(expected_model, expected, rank, 1, first=2)
        train_sharded(model, opt, rank, 1, first=2)
        assert_same(expected_model, expected, model, opt, f"{what}, a step later")


def every_master_mode_into_stock(rank, root, state_dtype):
    """FusedAmpAdamW(mode) -> stock AdamW, the checkpoint as the optimizer wrote it (through dcp_load) or in
    torch's form (``to_torch_state_dict`` of the sharded state, through plain dcp.load): the saved params, the
    moments decoded to fp32 (stock casts them to bf16). And -> FusedAmpAdamW's default mode: the decoded
    moments; the master the checkpoint holds (torch's form: every mode's, split ones joined with their
    params), else one from the param."""
    import torch.distributed.checkpoint as dcp

    for master_weights in MASTERS:
        mode = f"master_weights={master_weights} state_dtype={state_dtype}"
        path = f"{root}/fused-{master_weights}"
        saved_model = sharded(interchange_bf16_model())
        saved = fused(saved_model, master_weights, state_dtype)
        train_sharded(saved_model, saved, rank, 2)
        if state_dtype in ("int8", "int4"):
            assert "exp_avg_codes" in saved.state[saved_model[2].weight], f"the test needs {state_dtype} moments in the checkpoint"
        save_dcp(path, saved_model, saved)
        save_torch_form(f"{path}-torch", saved_model, saved)
        decoded = [_compact.decode_state({k: local(v) for k, v in saved.state[p].items()}, local(p))
                   for p in saved_model.parameters()]
        for loader, source, what in ((ampfused.checkpoint.dcp_load, path, f"{mode} -> stock"),
                                     (dcp.load, f"{path}-torch", f"{mode} in torch's form -> stock, plain dcp.load")):
            model = sharded(interchange_bf16_model())
            stock = torch.optim.AdamW(model.parameters(), **HYPER)
            load_with(loader, source, model, stock)
            for i, (p, q) in enumerate(zip(saved_model.parameters(), model.parameters())):
                assert torch.equal(bits(p), bits(q)), f"{what}: param {i}"
                for key in ("exp_avg", "exp_avg_sq"):
                    got = local(stock.state[q][key])
                    assert got.dtype == torch.bfloat16, f"{what}: stock keeps bf16 moments for bf16 params"
                    assert torch.equal(bits(got), bits(decoded[i][key].to(torch.bfloat16))), f"{what}: {key} of param {i}"
                assert float(stock.state[q]["step"]) == 2
            train_sharded(model, stock, rank, 1, first=2)  # and stock trains on
            assert all(torch.isfinite(local(p)).all() for p in model.parameters())
        for source, what in ((path, f"{mode} -> default mode"), (f"{path}-torch", f"{mode} in torch's form -> default mode")):
            model = sharded(interchange_bf16_model())
            opt = fused(model, None, None)
            load_with(ampfused.checkpoint.dcp_load, source, model, opt)
            opt.state_dict()  # (masters left to the params are taken by now)
            carried = master_weights is None or source.endswith("-torch")  # a split master needs its param
            for i, (p, q) in enumerate(zip(saved_model.parameters(), model.parameters())):
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(bits(opt.state[q][key]), bits(decoded[i][key])), f"{what}: {key} of param {i}"
                master = decoded[i]["master_param"] if carried and master_weights is not False else local(q).float()
                assert torch.equal(bits(opt.state[q]["master_param"]), bits(master)), f"{what}: master {i}"


def save_torch_form(root, model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd = ampfused.checkpoint.to_torch_state_dict(optim_sd, dict(model.named_parameters()))
    assert all(not _compact.is_compact_key(k) for entry in optim_sd["state"].values() for k in entry)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)


def _interchange_worker(rank, world, root, state_dtype):
    stock_into_every_master_mode(rank, root, state_dtype)
    every_master_mode_into_stock(rank, root, state_dtype)


@pytest.mark.parametrize("state_dtype", [None, pytest.param(torch.bfloat16, marks=pytest.mark.slow),
                                         pytest.param("int8", id="int8", marks=pytest.mark.slow),
                                         pytest.param("int4", id="int4", marks=pytest.mark.slow)],
                         ids=["fp32-moments", "bf16-moments", "int8-moments", "int4-moments"])
def test_stock_and_fused_dcp_checkpoints_load_into_each_other_in_every_mode(tmp_path, state_dtype):
    run(_interchange_worker, 2, str(tmp_path), state_dtype, timeout=240)


def _stale_master_worker(rank, world, root):
    """Stock AdamW is handed a FusedAmpAdamW state (fp32 masters), carries the masters along in bf16 while it
    trains, and saves through DCP; FusedAmpAdamW loading that takes its masters from the params, warning once
    through dcp_load (plain dcp.load hands it a cast master it cannot tell apart, and takes it from the params too)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    source_model = sharded(interchange_bf16_model())
    source = fused(source_model, None, None)
    train_sharded(source_model, source, rank, 2)
    stock_model = sharded(interchange_bf16_model())
    stock_model.load_state_dict(source_model.state_dict())
    stock = torch.optim.AdamW(stock_model.parameters(), **HYPER)
    set_optimizer_state_dict(stock_model, stock, get_optimizer_state_dict(source_model, source))
    assert all(stock.state[p]["master_param"].dtype == torch.bfloat16 for p in stock_model.parameters())
    train_sharded(stock_model, stock, rank, 3, first=2)
    carried = [(stock.state[p]["master_param"], p) for p in stock_model.parameters()]
    assert all(not torch.equal(local(m).float(), local(p).float()) for m, p in carried), "the test needs stale masters"
    save_dcp(f"{root}/stale", stock_model, stock)
    model = sharded(interchange_bf16_model())
    opt = fused(model, None, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_with(ampfused.checkpoint.dcp_load, f"{root}/stale", model, opt)
    stale = [w for w in caught if "is not float32" in str(w.message)]
    assert len(stale) == 1, f"one warning, got {[str(w.message) for w in caught]}"
    check_masters_are_params(model, opt, "dcp_load")
    # plain dcp.load casts the bf16 master into the fp32 one asked for: not seen, but not taken either
    model = sharded(interchange_bf16_model())
    opt = fused(model, None, None)
    load_with(dcp.load, f"{root}/stale", model, opt)
    check_masters_are_params(model, opt, "dcp.load")
    for i, (p, q) in enumerate(zip(model.parameters(), stock_model.parameters())):
        assert torch.equal(bits(p), bits(q)), f"param {i} is not the saved one"


def check_masters_are_params(model, opt, what):
    opt.state_dict()  # the masters a load left to the params are taken here at the latest
    for i, p in enumerate(model.parameters()):
        assert torch.equal(local(opt.state[p]["master_param"]), local(p).float()), f"{what}: master {i} is not the param"


def test_a_stale_master_in_a_dcp_checkpoint_is_not_taken(tmp_path):
    run(_stale_master_worker, 2, str(tmp_path), timeout=180)


def _data_parallel_worker(rank, world, root):
    """A checkpoint through data_parallel on an all-bf16 model (its fallback wrapper, no DDP reducer) has a
    DDP's keys and loads into an unwrapped, a DDP and an FSDP2 model: params and optimizer state, bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = interchange_bf16_model()
    opt = ampfused.FusedAmpAdamW(model.parameters(), **HYPER, backend=kernel_backend())
    wrapped = ampfused.distributed.data_parallel(model, opt)
    assert isinstance(wrapped, DDP), "the fallback wrapper is a DistributedDataParallel to code that asks"
    train_sharded(wrapped, opt, rank, 2)
    model_sd, optim_sd = get_state_dict(wrapped, opt)
    assert set(model_sd) == set(model.state_dict()), f"keys with a prefix: {sorted(model_sd)}"
    assert set(optim_sd["state"]) == {n for n, _ in model.named_parameters()}
    save_dcp(f"{root}/dp", wrapped, opt)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved_state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    for name, into in (("unwrapped", interchange_bf16_model()), ("DDP", DDP(interchange_bf16_model())), ("FSDP2", sharded(interchange_bf16_model()))):
        loaded = ampfused.FusedAmpAdamW(into.parameters(), **HYPER, backend=kernel_backend(), fp32_grad_accumulation=False)
        load_with(dcp.load, f"{root}/dp", into, loaded)
        loaded.state_dict()  # (masters pending from the params, if any, are taken now)
        bare = into.module if isinstance(into, DDP) else into
        for n, p in bare.named_parameters():
            assert torch.equal(bits(p.full_tensor() if hasattr(p, "full_tensor") else p), bits(saved[n])), f"{name}: {n}"
            for key, value in saved_state[n].items():
                got = loaded.state[p][key]
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                assert torch.equal(bits(got), bits(value)), f"{name}: {key} of {n}"


def test_data_parallel_checkpoints_load_unwrapped_into_ddp_and_into_fsdp2(tmp_path):
    run(_data_parallel_worker, 2, str(tmp_path), timeout=180)
