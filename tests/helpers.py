"""Helpers shared by the semantic tests: tolerances per backend and state comparison."""
import torch

from ampfused import _backends
from ampfused.check import KERNEL_TOLERANCE, TOLERANCES  # one table for the tests and `python -m ampfused check`

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_backends(device=DEVICE):
    """Names of the backends that can serve tensors on ``device`` in this process."""
    names = []
    for name in _backends.BACKEND_NAMES:
        try:
            _backends.resolve(name, device)
        except RuntimeError:
            continue
        names.append(name)
    return names


STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def tol(backend):
    return TOLERANCES.get(backend, KERNEL_TOLERANCE)


def assert_params_close(expected, actual, backend, msg=""):
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        torch.testing.assert_close(a.detach().float().cpu(), e.detach().float().cpu(), **tol(backend), msg=f"{msg} param {i}")


def assert_states_close(expected_opt, expected_params, actual_opt, actual_params, backend, keys=STATE_KEYS):
    """Params and every AdamW state tensor of two optimizers over the same parameter structure."""
    assert_params_close(expected_params, actual_params, backend, "params:")
    for i, (pe, pa) in enumerate(zip(expected_params, actual_params, strict=True)):
        se, sa = expected_opt.state[pe], actual_opt.state[pa]
        assert (not se) == (not sa), f"param {i}: state presence differs"
        for key in keys:
            assert (key in se) == (key in sa), f"param {i}: key {key!r} present in one state only"
            if key in se:
                torch.testing.assert_close(sa[key].float().cpu(), se[key].float().cpu(), **tol(backend), msg=f"param {i} state {key}")


def snapshot(opt, params):
    """Bitwise copies of params, main grads and every state tensor, for skip checks."""
    snap = {"params": [p.detach().clone() for p in params]}
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            snap[(i, key)] = value.clone()
    return snap


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        xs, ys = (a[key], b[key]) if key == "params" else ([a[key]], [b[key]])
        for x, y in zip(xs, ys, strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8),
                                                       y.view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8)), f"{key} changed"


def make_params(shapes, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def clone_params(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def random_grads(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=g) * scale).to(device=p.device) for p in params]


# ------------------------------------------------------------------ compact state: (param, grad, state) entries


def clone_compact(entry):
    param, grad, state = entry
    return param.clone(), grad.clone(), {k: t.clone() for k, t in state.items()}


def same_bits(actual, expected, what):
    """Bitwise equality of two tensors of one dtype and shape, NaN == NaN whatever the payload."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.is_floating_point():
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
        actual, expected = actual[~nan].view(width), expected[~nan].view(width)
    bad = (actual != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {expected.numel()} differ, first at {bad[:4].tolist()}"


def assert_same_state(actual, expected, what=""):
    a_param, _, a_state = actual
    e_param, _, e_state = expected
    same_bits(a_param, e_param, f"{what} param")
    assert set(a_state) == set(e_state)
    for key in e_state:
        same_bits(a_state[key], e_state[key], f"{what} {key}")


COMPACT_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
MASTER_KEYS = ("master_param", "master_low16", "master_residual8")


def compact_hyper(amsgrad=False, maximize=False):
    from ampfused._contract import Hyper

    h = COMPACT_HYPER
    return Hyper(h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], amsgrad, maximize)


def shifted(t, offset):
    """t copied into a view that starts ``offset`` elements into its storage (0: t itself)."""
    if offset == 0:
        return t
    storage = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = storage[offset:].view(t.shape)
    view.copy_(t)
    return view


def compact_entry(n, param_dtype, master_weights, state_dtype, device, amsgrad=False, seed=0, offset=0):
    """(param, grad, compact state) on ``device`` with non-trivial moments and master; ``offset`` > 0
    makes every tensor a view that starts ``offset`` elements into its storage (no vector access)."""
    from ampfused import _compact

    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    fp32_state = {"step": torch.tensor(float(seed % 5 + 2)), "exp_avg": torch.randn(n, generator=gen) * 0.1,
                  "exp_avg_sq": torch.rand(n, generator=gen) * 0.01, "master_param": master}
    if amsgrad:
        fp32_state["max_exp_avg_sq"] = fp32_state["exp_avg_sq"] + torch.rand(n, generator=gen) * 0.01
    param = shifted(master.to(param_dtype).to(device), offset)
    grad = shifted(torch.randn(n, generator=gen).to(device), offset)
    state = _compact.encode_state(param, {k: t.to(device) for k, t in fp32_state.items()}, master_weights, state_dtype)
    state = {k: t if t.dim() == 0 or k.endswith("_scales") else shifted(t, offset) for k, t in state.items()}
    return param, grad, state


def update_lists(entries):
    """The backend update's per-tensor lists from [(param, grad, compact state)]."""
    out = dict(params=[], grads=[], exp_avgs=[], exp_avg_sqs=[], max_exp_avg_sqs=[], steps=[], masters=[], moment_scales=[])
    for param, grad, state in entries:
        out["params"].append(param)
        out["grads"].append(grad)
        out["steps"].append(state["step"])
        out["masters"].append(next((state[k] for k in MASTER_KEYS if k in state), None))
        if "exp_avg_codes" in state:
            out["exp_avgs"].append(state["exp_avg_codes"])
            out["exp_avg_sqs"].append(state["exp_avg_sq_codes"])
            out["max_exp_avg_sqs"].append(state.get("max_exp_avg_sq_codes"))
            out["moment_scales"].append((state["exp_avg_scales"], state["exp_avg_sq_scales"], state.get("max_exp_avg_sq_scales")))
        else:
            out["exp_avgs"].append(state["exp_avg"])
            out["exp_avg_sqs"].append(state["exp_avg_sq"])
            out["max_exp_avg_sqs"].append(state.get("max_exp_avg_sq"))
            out["moment_scales"].append(None)
    return out


def compact_update(backend, entries, amsgrad=False, maximize=False, factor=1.0, skip=0.0, grad_scale=None,
                   rounding_seed=None):
    """One ``backend.adamw_update_`` of ``entries`` (one group, COMPACT_HYPER), the stats slots set."""
    from ampfused._contract import FACTOR, SKIP

    lists = update_lists(entries)
    stats = torch.zeros(4, device=entries[0][0].device)
    stats[FACTOR], stats[SKIP] = factor, skip
    backend.adamw_update_(batch_of(lists, [0] * len(entries), [compact_hyper(amsgrad, maximize)]), stats,
                          grad_scale=grad_scale, rounding_seed=rounding_seed)


def batch_of(lists, group_ids, groups):
    """The ``_contract.Batch`` the backends' passes take, from ``update_lists``' dict."""
    from ampfused._contract import Batch

    return Batch(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"], lists["max_exp_avg_sqs"],
                 lists["steps"], lists["masters"], group_ids, groups, lists.get("moment_scales"))


def decoded_twin(entry):
    """The same state in the plain layout: fp32 moments and fp32 master (decoded), which the fp32 paths step."""
    from ampfused import _compact

    param, grad, state = entry
    return param.clone(), grad.clone(), {k: t.clone() for k, t in _compact.decode_state(state, param).items()}
