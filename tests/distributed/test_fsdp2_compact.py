"""Every memory mode under FSDP2 (DESIGN §8-9, [note: blocks in rows] in ampfused/_contract.py).

On 2 and 4 gloo ranks, with and without MixedPrecisionPolicy, FusedAmpAdamW stepping the shards of a
``fully_shard`` model equals one process stepping the whole model on the same global gradients,
bitwise: every param and every state tensor gathered with ``full_tensor()`` (int8 and packed int4
codes and their scales, split16 / split8 masters, bf16 moments), stochastic rounding included (its
bits are keyed by the element's index in the whole tensor). The model's rows are no whole number of
blocks and its shards uneven (an empty one on 4 ranks). ``full_state_dict`` gathers every mode; a DCP
checkpoint saved on 2 ranks loads on 4, and the blockwise modes' on 1, and equals the one-process state.
The cpu and reference backends run every mode; Triton (the interpreter) the modes of TRITON_MODES.
"""
import warnings

import pytest
import torch

import ampfused
from dist_utils import rank_backends, rank_device, requires_gloo, run
from helpers import bits
from test_fsdp2 import full

pytestmark = requires_gloo
STEPS = 3
# weights [70, 256] (whole blocks), [96, 70] (rows of 70), [3, 96] (small: fp32 moments); even rows: int4 applies
WIDTHS = (256, 70, 96, 3)
BLOCKWISE = ("int8", "int4")
# (master_weights, state_dtype, stochastic_rounding) on a bf16 model
BF16_MODES = [("fp32", "int8", False), ("split16", "int8", False), ("split8", "int8", False), (False, "int8", True),
              ("split16", torch.float32, False), ("split8", torch.bfloat16, True), (False, torch.bfloat16, True),
              ("split16", "int4", False), (False, "int4", True)]
# on an fp32 model under MixedPrecisionPolicy(bf16 compute): the params are their own masters
MP_MODES = [(None, "int8", False), (None, torch.bfloat16, True), (None, "int4", False)]
# Triton through the interpreter on 2 ranks (the cpu and reference backends run every mode): the modes
# whose kernels read a shard's global position, the row blocks of int8 and int4 and the rounding bits
# keyed by the element's global index, each encoding once
TRITON_MODES = [("split8", "int8", False), ("split8", torch.bfloat16, True), (False, "int4", True)]


def compact_mlp(dtype, sharded, mp_policy=None):
    from helpers import mlp

    model = mlp(*WIDTHS, dtype=dtype, device=rank_device())
    if sharded:
        from torch.distributed.fsdp import fully_shard

        kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
        for layer in model[::2]:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    return model


def compact_opt(model, mode, backend):
    master_weights, state_dtype, sr = mode
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an option with no effect on fp32 params warns; not what this tests)
        return ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=master_weights,
                                      state_dtype=state_dtype, stochastic_rounding=sr, backend=backend,
                                      fp32_grad_accumulation=False)  # (FSDP2 writes the grads; the one process's are set)


def global_grad(p, step, i):
    """The same global gradient on every rank and in the one process."""
    g = torch.Generator().manual_seed(1000 * step + i)
    return (torch.randn(tuple(p.shape), generator=g) * 1e-2).to(device=rank_device(), dtype=p.dtype)


def train_on_global_grads(model, opt, rank, sharded, steps=STEPS, first=0):
    """A forward and backward through the (sharded) model, then the global gradients in its place: the
    optimizer sees what one process would, whatever FSDP2's reduction rounded."""
    from torch.distributed.tensor import distribute_tensor

    for step in range(first, first + steps):
        x = torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(step * 10 + rank)).to(rank_device())
        model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
        for i, p in enumerate(model.parameters()):
            g = global_grad(p, step, i)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if sharded else g
        torch.manual_seed(100 + step)  # the rounding seed: the same draw on every rank and in the one process
        opt.step()
        opt.zero_grad()




def assert_same_gathered(expected: dict, actual: dict, what: str):
    """{name: {key: tensor}} bitwise, key sets included."""
    assert expected.keys() == actual.keys(), f"{what}: params {sorted(actual)} != {sorted(expected)}"
    for name, state in expected.items():
        assert state.keys() == actual[name].keys(), f"{what}: {name} keys {sorted(actual[name])} != {sorted(state)}"
        for key, value in state.items():
            got = actual[name][key]
            assert got.dtype == value.dtype and got.shape == value.shape, f"{what}: {name} {key} {got.dtype}{tuple(got.shape)}"
            assert torch.equal(bits(got), bits(value)), f"{what}: {name} {key} differs"


def gathered_state(model, opt):
    """{param name: {key: full tensor}} of the params and every state tensor, gathered from the shards."""
    names = dict(zip(model.parameters(), (n for n, _ in model.named_parameters())))
    out = {}
    for p, state in opt.state.items():
        out[names[p]] = {"param": full(p).detach().clone(), **{k: full(v).detach().clone() for k, v in state.items()}}
    return out


def compare_to_one_process(rank, world, backend, mode, mp_policy):
    dtype = torch.float32 if mp_policy is not None else torch.bfloat16
    what = f"{mode} mp={mp_policy is not None} backend={backend} world={world} rank={rank}"
    sharded = compact_mlp(dtype, True, mp_policy)
    opt = compact_opt(sharded, mode, backend)
    one = compact_mlp(dtype, False)
    one_opt = compact_opt(one, mode, backend)
    train_on_global_grads(sharded, opt, rank, True)
    train_on_global_grads(one, one_opt, rank, False)
    expected = gathered_state(one, one_opt)
    if mode[1] in BLOCKWISE:
        assert any(k.endswith("_codes") for s in expected.values() for k in s), f"{what}: the test must hold {mode[1]} codes"
        for p in sharded.parameters():
            for key, value in opt.state[p].items():
                if key.endswith(("_codes", "_scales")):  # placed as the param: Shard(0) by rows
                    assert type(value).__name__ == "DTensor", f"{what}: {key} of a DTensor param must be a DTensor"
                    assert value.placements == p.placements, f"{what}: {key} placed {value.placements}"
    assert_same_gathered(expected, gathered_state(sharded, opt), what)
    return sharded, opt, one, one_opt


def check_full_state_dict(model, opt, one_opt, what):
    """get_optimizer_state_dict(full_state_dict=True) gathers every state tensor (no int16 in a DTensor:
    gloo and NCCL move none) and equals the one process's state_dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    names = [n for n, _ in model.named_parameters()]
    one_sd = one_opt.state_dict()["state"]
    expected = {names[i]: {k: v for k, v in s.items()} for i, s in one_sd.items()}
    assert_same_gathered(expected, {n: dict(s) for n, s in sd["state"].items()}, f"{what}: full_state_dict")
    for state in opt.state.values():
        for key, value in state.items():
            assert value.dtype != torch.int16, f"{what}: {key} is int16, which collectives cannot move"


def _worker(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backends = [b for b in rank_backends() if b != "triton" or world == 2]  # the interpreter is too slow on 4 CPU ranks
    for backend in backends:
        for n, mode in enumerate(BF16_MODES):
            if backend == "triton" and mode not in TRITON_MODES:
                continue
            model, opt, _, one_opt = compare_to_one_process(rank, world, backend, mode, None)
            check_full_state_dict(model, opt, one_opt, f"{mode} {backend} world={world}")
            if root is not None and backend == backends[-1]:  # saved for the 2 -> 4 reshard below
                optim_sd = get_optimizer_state_dict(model, opt)
                dcp.save({"optim": optim_sd}, checkpoint_id=f"{root}/mode{n}")
                state = gathered_state(model, opt)  # (a collective: every rank gathers)
                if rank == 0:
                    torch.save(state, f"{root}/mode{n}.expected.pt")
        for mode in MP_MODES if backend != "triton" else MP_MODES[:1]:
            compare_to_one_process(rank, world, backend, mode, bf16)


def _reshard_worker(rank, world, root, modes=None):
    """Checkpoints of 2 ranks load on ``world`` ranks: the same state, gathered, bitwise (``modes``: the
    indices into BF16_MODES to load; None: all)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import distribute_tensor

    backend = [b for b in rank_backends() if b != "triton"][-1]
    for n, mode in enumerate(BF16_MODES):
        if modes is not None and n not in modes:
            continue
        expected = torch.load(f"{root}/mode{n}.expected.pt", weights_only=True)
        model = compact_mlp(torch.bfloat16, True)
        opt = compact_opt(model, mode, backend)
        train_on_global_grads(model, opt, rank, True, steps=1, first=7)  # state laid out (other values, overwritten by the load)
        with torch.no_grad():  # the model's own checkpoint: split masters are completed by these params
            for name, p in model.named_parameters():
                p.copy_(distribute_tensor(expected[name]["param"].to(p.device), p.device_mesh, p.placements))
        optim_sd = get_optimizer_state_dict(model, opt)
        dcp.load({"optim": optim_sd}, checkpoint_id=f"{root}/mode{n}")
        set_optimizer_state_dict(model, opt, optim_state_dict=optim_sd)
        assert_same_gathered(expected, gathered_state(model, opt), f"{mode}: saved on 2 ranks, loaded on {world}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_on_shards_equals_one_process(world, tmp_path):
    run(_worker, world, str(tmp_path) if world == 2 else None, timeout=540)
    if world == 2:
        run(_reshard_worker, 4, str(tmp_path), timeout=300)
        # and onto one rank (a checkpoint consolidated for a single-process run): the blockwise modes,
        # whose codes and scales are sharded by rows on 2 ranks and whole on 1
        blockwise = [n for n, mode in enumerate(BF16_MODES) if mode[1] in BLOCKWISE]
        run(_reshard_worker, 1, str(tmp_path), blockwise, timeout=300)


def _refusal_worker(rank, world):
    """Shards that are not whole rows (tensor parallelism's Shard(1)) are refused for int8 / int4 blocks
    and stochastic rounding, naming the placement; element-wise modes take them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(rank_device().type, (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(64, 128).to(torch.bfloat16), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match=r"sharded by rows \(Shard\(0\).*Shard\(dim=1\)"):
        ampfused.FusedAmpAdamW([p], state_dtype="int8")
    with pytest.raises(ValueError, match=r"sharded by rows \(Shard\(0\).*Shard\(dim=1\)"):
        ampfused.FusedAmpAdamW([p], state_dtype="int4")
    with pytest.raises(ValueError, match="stochastic_rounding=True .*Shard\\(dim=1\\)"):
        ampfused.FusedAmpAdamW([p], master_weights=False, stochastic_rounding=True)
    ampfused.FusedAmpAdamW([p], master_weights="split16", state_dtype=torch.bfloat16)


def test_shards_that_are_not_rows_are_refused_for_blocks_and_rounding():
    run(_refusal_worker, 2, timeout=120)
