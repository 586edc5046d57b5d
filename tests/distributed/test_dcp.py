"""torch.distributed.checkpoint with FusedAmpAdamW on FSDP2: get/set_optimizer_state_dict and DCP
save/load round-trip bitwise into FusedAmpAdamW and into torch.optim.AdamW, both ways, and reshard
(saved on 2 ranks, loaded on 4), after which both keep training alike."""
import pytest
import torch

import ampfused
from dist_utils import rank_backends, rank_device, requires_gloo, run
from helpers import tol
from test_fsdp2 import shard_batch, sharded_model

pytestmark = requires_gloo
KINDS = ("ampfused", "torch")


def make_opt(kind, model):
    if kind == "ampfused":
        return ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, backend=kernel_backend())
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def kernel_backend():
    """The compiled backend of this rank's device (the Triton interpreter is too slow for 4 CPU ranks)."""
    return next(b for b in rank_backends() if b != "triton" or rank_device().type == "cuda")


def train_shards(model, opt, rank, steps, first=0):
    for step in range(first, first + steps):
        x, y = shard_batch(rank, step, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def full_optim_state(model, opt):
    """{fqn: {key: full plain tensor}} gathered from every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {fqn: {k: v.clone() for k, v in s.items() if k in ("step", "exp_avg", "exp_avg_sq")} for fqn, s in sd["state"].items()}


def assert_state_equal(expected, actual, what):
    assert expected.keys() == actual.keys(), f"{what}: params differ"
    for fqn in expected:
        for key, value in expected[fqn].items():
            got = actual[fqn][key]
            assert torch.equal(got.float().reshape(value.shape), value.float()), f"{what}: {fqn} {key} differs"


def save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_checkpoint(kind, rank, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = sharded_model()
    opt = make_opt(kind, model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return model, opt


def _save_worker(rank, world, root):
    for kind in KINDS:
        model = sharded_model()
        opt = make_opt(kind, model)
        train_shards(model, opt, rank, 2)
        expected = full_optim_state(model, opt)
        save(model, opt, f"{root}/{kind}")
        if kind == "ampfused":  # full plain tensors for sharded params: refused, nothing written
            sd = opt.state_dict()
            sd["state"] = {i: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in st.items()} for i, st in sd["state"].items()}
            with pytest.raises(ValueError, match="plain tensor but the parameter is a DTensor"):
                opt.load_state_dict(sd)
            assert_state_equal(expected, full_optim_state(model, opt), "a refused load_state_dict")
        if rank == 0:
            torch.save(expected, f"{root}/{kind}.expected.pt")
        for into in KINDS:  # same world: bitwise, into either class
            loaded_model, loaded = load_checkpoint(into, rank, f"{root}/{kind}")
            assert_state_equal(expected, full_optim_state(loaded_model, loaded), f"{kind} -> {into} on {world} ranks")
            if into == "ampfused":
                p = next(iter(loaded.state))
                assert type(loaded.state[p]["exp_avg"]).__name__ == "DTensor"


def _load_worker(rank, world, root):
    trained = {}
    for kind in KINDS:
        expected = torch.load(f"{root}/{kind}.expected.pt", weights_only=True)
        for into in KINDS:
            model, opt = load_checkpoint(into, rank, f"{root}/{kind}")
            assert_state_equal(expected, full_optim_state(model, opt), f"{kind} (2 ranks) -> {into} ({world} ranks)")
            train_shards(model, opt, rank, 2, first=2)
            trained[(kind, into)] = [p.full_tensor() for p in model.parameters()]
    reference = trained[("torch", "torch")]
    for key, params in trained.items():
        tolerance = tol("reference") if key == ("torch", "torch") else tol(kernel_backend())
        for i, (a, b) in enumerate(zip(params, reference)):
            torch.testing.assert_close(a, b, **tolerance, msg=f"{key}: param {i} after training on from the checkpoint")


def test_dcp_round_trip_and_reshard_2_to_4(tmp_path):
    run(_save_worker, 2, str(tmp_path), timeout=180)
    run(_load_worker, 4, str(tmp_path), timeout=180)
