"""Stochastic rounding draws the same bits on every backend: one counter-based hash of (seed, the
tensor's index in the step's full lists, element index), [note: rounding bits] in
ampfused/_contract.py, specified by ``ampfused._compact.random_words``.

One SR step (bf16 moments with SR, bf16 params without master with SR) runs on each backend and
must equal the reference bit for bit. The step is split on the kernel backends: an fp64 param and
a non-dense bf16 param go to the reference passes, so the kernels' share sits at other positions
of its own lists than of the step's; both shares must still draw the bits the reference draws for
the whole step. The AdamW math of the step is exact on every backend (``lr = 0`` where grads and
moments are random; zero grads and moments where the weights decay), so any difference is a
difference of random bits. The CUDA kernel runs through the host emulation
(the ``cuda_emulation`` fixture of tests/compact/conftest.py).
"""
import pytest
import torch

from ampfused import _backends
from ampfused import _compact as C
from ampfused.functional import fused_amp_adamw
from helpers import DEVICE, same_bits

N = 5000  # several int8 blocks' worth, a ragged tail, and more than one interpreter block
SEED = 2**61 + 987654321  # both seed words non-zero
MOVING = dict(lr=0.0, weight_decay=0.0)  # random grads and moments: only the moments move (and round)
DECAYING = dict(lr=0.5, weight_decay=0.1)  # zero grads and moments: only the weights move, w * (1 - lr wd)


def bf16(t):
    return t.to(torch.bfloat16)


def step_lists(device):
    """The step's per-tensor lists and hyperparameters (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    rows = []  # (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper)
    rows.append((randn(N).double(), randn(N).double(), torch.zeros(N).double(), torch.zeros(N).double(),
                 torch.zeros(N).double(), MOVING))  # fp64: the reference passes serve it
    for shape in ((N,), (50, 2 * N // 50)):  # the second becomes a non-dense view: the reference serves it
        v = rand(*shape) * 1e-2
        rows.append((bf16(randn(*shape)), randn(*shape), bf16(randn(*shape) * 0.1), bf16(v), bf16(v + rand(*shape) * 1e-2),
                     MOVING))
    rows.append((bf16(randn(N)), torch.zeros(N), torch.zeros(N), torch.zeros(N), torch.zeros(N), DECAYING))
    rows.append((bf16(randn(N)), torch.zeros(N), bf16(torch.zeros(N)), bf16(torch.zeros(N)), bf16(torch.zeros(N)),
                 DECAYING))
    lists = [[t.to(device) for t in row[:5]] for row in rows]
    lists[2] = [t[:, ::2] for t in lists[2]]  # every other column: gaps in memory
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = map(list, zip(*lists))
    steps = [torch.tensor(3.0, device=device) for _ in rows]
    hypers = dict(lr=[row[5]["lr"] for row in rows], weight_decay=[row[5]["weight_decay"] for row in rows])
    return (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps), hypers


def rounded_step(backend):
    lists, hypers = step_lists(DEVICE)
    fused_amp_adamw(*lists, **hypers, beta1=0.9, beta2=0.999, eps=1e-8, amsgrad=True, skip_nonfinite=False,
                    backend=backend, rounding_seed=SEED)
    return lists


def assert_same_step(actual, expected, what):
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
    for name, got, want in zip(names, actual, expected):
        for i, (a, b) in enumerate(zip(got, want)):
            if a.dtype == torch.float64:
                assert torch.equal(a, b), f"{what}: tensor {i} {name}"
            else:
                same_bits(a, b, f"{what}: tensor {i} {name}")


def test_the_step_rounds_stochastically():
    """The step is one that shows the bits: SR moved values off round-to-nearest, in every write."""
    sr = rounded_step("reference")
    lists, hypers = step_lists(DEVICE)
    fused_amp_adamw(*lists, **hypers, beta1=0.9, beta2=0.999, eps=1e-8, amsgrad=True, skip_nonfinite=False,
                    backend="reference")
    for i, j in ((1, 2), (1, 3), (1, 4), (2, 2), (3, 0), (4, 0)):  # (tensor, list): moments of 1, 2; params of 3, 4
        assert not torch.equal(sr[j][i], lists[j][i]), f"tensor {i}, list {j}: SR gave the RNE bits"


def test_every_backend_draws_the_reference_bits(backend):
    assert_same_step(rounded_step(backend), rounded_step("reference"), backend)


def test_the_cuda_kernel_draws_the_reference_bits(cuda_emulation, monkeypatch):
    expected = rounded_step("reference")
    emulated = cuda_emulation
    monkeypatch.setattr(_backends, "resolve", lambda requested, device: (emulated, "emulated cuda"))
    assert_same_step(rounded_step(None), expected, "emulated cuda")


def test_the_index_keys_the_bits():
    """Another index (the same tensor elsewhere in the lists) or another seed: other bits."""
    elements = torch.arange(1 << 12)
    words = C.random_words(SEED, 1, elements)
    for other in (C.random_words(SEED, 2, elements), C.random_words(SEED + 1, 1, elements),
                  C.random_words(SEED + (1 << 31), 1, elements)):
        for a, b in zip(words, other):
            assert (a == b).double().mean() < 0.01


@pytest.mark.parametrize("word,shift", [(0, 0), (0, 16), (1, 0), (1, 16)],
                         ids=["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param"])
def test_the_bits_round_without_bias(word, shift):
    """Each 16-bit half the writes take is uniform, so SR is unbiased: over many elements the mean
    rounding error, in units of the bf16 spacing, is near 0, where round-down would give -1/2."""
    n = 1 << 18
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    rand = (C.random_words(SEED, 7, torch.arange(n))[word] >> shift) & 0xFFFF
    assert abs(rand.double().mean().item() / 65535 - 0.5) < 0.005
    rounded = C.stochastic_round_bf16(x, rand).double()
    low = (C._bits(x) >> 16 << 16)  # the bf16 neighbour toward zero
    spacing = (C._from_bits(low + 0x10000).double() - C._from_bits(low).double()).abs()
    err = ((rounded - x.double()) / spacing)
    # per element err is in (-1, 1) with variance <= 1/4: five standard errors of the mean
    assert abs(err.mean().item()) < 5 * 0.5 / n ** 0.5, err.mean().item()
    assert 0.4 < (rounded.abs() > x.double().abs()).double().mean().item() < 0.6


def test_a_shard_draws_the_bits_of_its_whole_tensor(kernel):
    """FSDP2 steps a row shard of a tensor with its offset in the whole tensor (``element_base``): the
    two row shards of a tensor, each stepped alone (at the tensor's position, as on its rank), draw
    the bits the whole tensor draws; a shard past 2^32 elements draws the specification's
    (``reference``; the math is exact: lr = 0); one whose elements cross a multiple of 2^32 is left
    to the reference passes, which key each element."""
    from ampfused import functional, reference
    from ampfused._batch import Hyper
    from helpers import clone_compact, compact_update, compact_entry

    hypers = [Hyper(0.0, 0.9, 0.999, 1e-8, 0.0, True, False)]  # only the moments move (and round)
    rows, cols, cut = 64, 90, 40
    whole = compact_entry((rows, cols), torch.bfloat16, "none", torch.bfloat16, kernel.device, amsgrad=True, seed=3)
    shards = [tuple(t[part].clone() if t.dim() else t.clone() for t in (whole[0], whole[1]))
              + ({k: v[part].clone() if v.dim() else v.clone() for k, v in whole[2].items()},)
              for part in (slice(0, cut), slice(cut, rows))]
    kernel.step([whole], hypers=hypers, rounding_seed=SEED)
    for shard, base in zip(shards, (0, cut * cols)):
        kernel.step([shard], hypers=hypers, rounding_seed=SEED, element_base=[base])
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        same_bits(torch.cat([s[2][key] for s in shards]), whole[2][key], f"{kernel.name} {key}: shards vs whole")
        assert not torch.equal(shards[1][2][key], shards[0][2][key][: rows - cut]), "the halves share no bit sequence"

    ours = compact_entry((3, 1000), torch.bfloat16, "none", torch.bfloat16, kernel.device, amsgrad=True, seed=4)
    spec = clone_compact(ours)
    base = 2 * 2**32 + 2**31 + 12345  # high word 2, the low word far from 0
    kernel.step([ours], hypers=hypers, rounding_seed=SEED, element_base=[base])
    compact_update(reference, [spec], hypers=hypers, rounding_seed=SEED, element_base=[base])
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        same_bits(ours[2][key], spec[2][key], f"{kernel.name} {key}: a shard past 2^32 elements")
    backend = kernel.backend
    for base, crosses in ((2**32 - 1700, True), (2**32 - 3000, False), (0, False)):
        wide = functional.fallback_indices(backend, [ours[0]], [ours[2]["exp_avg"]], [None], stochastic=True,
                                           element_base=[base])
        assert wide == ([0] if crosses and backend is not reference else []), (base, wide)
