"""The compact-state encodings of ampfused._compact against the bounds its docstring states.

Masters are built from bit patterns so that every exponent (and sign, zeros, subnormals, inf, NaN)
of the 16-bit formats is covered, not just what randn happens to produce.
"""
import pytest
import torch

from ampfused import _compact as C


def f32(bits):
    """int64 tensor of fp32 bit patterns -> fp32 tensor."""
    return C._from_bits(torch.as_tensor(bits, dtype=torch.int64))


def every_high_half(lows=(0x0000, 0x0001, 0x1234, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF)):
    """fp32 masters with every possible high half (every bf16 sign, exponent and mantissa) and chosen low halves."""
    hi = torch.arange(1 << 16, dtype=torch.int64)
    return f32((hi[:, None] << 16) | torch.tensor(lows, dtype=torch.int64)[None, :]).reshape(-1)


def random_in_binades(exponent_fields, per_binade=256, seed=0):
    """fp32 masters with random mantissas and both signs in each given fp32 exponent field."""
    g = torch.Generator().manual_seed(seed)
    e = torch.as_tensor(exponent_fields, dtype=torch.int64).repeat_interleave(per_binade)
    mant = torch.randint(0, 1 << 23, e.shape, generator=g)
    sign = torch.randint(0, 2, e.shape, generator=g) << 31
    return f32(sign | (e << 23) | mant)


def ulp16(p):
    return torch.pow(2.0, C._ulp_exponent(p).double())


# ------------------------------------------------------------------ split16

def test_split16_param_is_rne_and_join_is_bitwise_but_at_ties():
    m = every_high_half()
    p, low = C.split16(m)
    assert p.dtype == torch.bfloat16 and low.dtype == C.MASTER_ENCODINGS["split16"][0] and low.shape == m.shape
    nan = torch.isnan(m)
    assert torch.equal(p.view(torch.int16)[~nan], m.to(torch.bfloat16).view(torch.int16)[~nan])
    assert torch.isnan(p[nan]).all()
    back = C.join16(p, low)
    tie = ((C._bits(m) & 0xFFFF) == 0x8000) & ~nan
    same = C._bits(back) == C._bits(m)
    assert same[~tie & ~nan].all(), "join16(split16(m)) must be m bit for bit away from ties"
    assert torch.isnan(back[nan]).all()
    assert tie.sum() > 60000  # every high half has one tie low half, most are finite


def test_split16_tie_rule_moves_one_ulp_toward_the_param():
    m = every_high_half(lows=(0x8000,))
    m = m[torch.isfinite(m)]
    p, low = C.split16(m)
    back = C.join16(p, low)
    assert torch.equal(back.to(torch.bfloat16).view(torch.int16), p.view(torch.int16)), "p must stay RNE(master)"
    moved = C._bits(back) - C._bits(m)
    assert ((moved == 1) | (moved == -1)).all(), "a tie moves the master by exactly one fp32 ulp"
    # toward the param: the nudged master lies between the tie and the param
    pf = p.float().double()
    assert ((back.double() - m.double()) * (pf - m.double()) > 0).all()
    finite_p = torch.isfinite(pf)
    assert ((back.double() - pf).abs() < (m.double() - pf).abs())[finite_p].all()


def test_split16_special_values():
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 1e-39, 3.4028235e38, -3.4028235e38])
    p, low = C.split16(specials)
    back = C.join16(p, low)
    assert torch.equal(C._bits(back), C._bits(specials)), "zeros keep their sign, subnormals and overflowing masters are kept"
    assert torch.isinf(p[-2:]).all(), "a master beyond bf16's range has an inf param and is still kept exactly"


# ------------------------------------------------------------------ split8

BF16_FIELDS = list(range(0, 255))  # every finite fp32 exponent: every bf16 binade incl. subnormals
FP16_FIELDS = list(range(127 - 27, 127 + 16))  # below fp16's smallest subnormal up to its largest binade


@pytest.mark.parametrize("dtype,fields", [(torch.bfloat16, BF16_FIELDS), (torch.float16, FP16_FIELDS)], ids=["bf16", "fp16"])
def test_split8_error_bound_over_every_exponent(dtype, fields):
    m = random_in_binades(fields)
    p, q = C.split8(m, dtype)
    ok = torch.isfinite(p)  # fp16 params overflow above 65504: documented, checked below
    m, p, q = m[ok], p[ok], q[ok]
    assert torch.equal(p.view(torch.int16), m.to(dtype).view(torch.int16))
    back = C.join8(p, q)
    ulp = ulp16(p)
    err = (back.double() - m.double()).abs()
    assert (err <= ulp / 256).all(), f"max error {(err / ulp).max().item()} ulp(p)"
    inner = (m.double() - p.double()).abs() <= ulp * 255 / 512
    assert (err[inner] <= ulp[inner] / 512).all(), f"max inner error {(err[inner] / ulp[inner]).max().item()} ulp(p)"
    assert torch.equal(back.to(dtype).view(torch.int16), p.view(torch.int16)), "RNE(join8) must be the param"
    # every binade was exercised (bf16: 255 finite exponents of either sign)
    assert C._ulp_exponent(p).unique().numel() >= (200 if dtype == torch.bfloat16 else 30)
    # decoding is exact, so a decoded master encodes back to the same (param, residual)
    p2, q2 = C.split8(back, dtype)
    assert torch.equal(p2.view(torch.int16), p.view(torch.int16)) and torch.equal(q2, q)


def test_split8_special_values_and_overflow():
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3e-8])
        p, q = C.split8(x, dtype)
        back = C.join8(p, q)
        assert torch.equal(C._bits(back[:4]), C._bits(x[:4])), "zeros keep their sign, infs stay"
        assert torch.isnan(back[4])
        assert (back[5:] - x[5:]).abs().max() <= 2.0 ** -32
    p, q = C.split8(torch.tensor([70000.0, -1e5]), torch.float16)
    assert torch.isinf(C.join8(p, q)).all(), "a master whose fp16 param overflows decodes to the param's inf"


def test_split_masters_refuse_params_they_cannot_complete():
    """split16 completes bf16 params only, split8 bf16 and fp16 (_contract.MASTER_PARAM_DTYPES): the
    spec's join and split refuse any other, naming the encoding and what it needs."""
    with pytest.raises(TypeError, match=r"split16 low halves\), which needs a bfloat16 param, not float16"):
        C.join16(torch.zeros(2, dtype=torch.float16), torch.zeros(2, dtype=torch.int16))
    for call in (lambda: C.split8(torch.zeros(2), torch.float32),
                 lambda: C.join8(torch.zeros(2), torch.zeros(2, dtype=torch.int8))):
        with pytest.raises(TypeError, match=r"split8 residuals\), which needs a bfloat16 or float16 param, not float32"):
            call()


# ------------------------------------------------------------------ bf16 rounding

def test_rne_is_torch_rounding_on_every_high_half():
    m = every_high_half()
    ours = C.round_bf16(m)
    nan = torch.isnan(m)
    assert torch.equal(ours.view(torch.int16)[~nan], m.to(torch.bfloat16).view(torch.int16)[~nan])
    assert torch.isnan(ours[nan]).all()


def test_stochastic_rounding_picks_a_neighbour_and_keeps_specials():
    m = every_high_half()
    r = C.round_bf16(m, stochastic=True, generator=torch.Generator().manual_seed(1))
    fin = torch.isfinite(m)
    lower = C._bits(m)[fin] >> 16
    got = C._bits16(r)[fin]
    assert ((got == lower) | (got == lower + 1) | ((got == lower) & ((C._bits(m)[fin] & 0xFFFF) == 0))).all()
    rne_finite = torch.isfinite(m.to(torch.bfloat16))
    assert torch.isfinite(r[rne_finite]).all(), "SR never rounds to inf where RNE stays finite"
    assert torch.isnan(r[torch.isnan(m)]).all()
    assert torch.equal(r[torch.isinf(m)], m[torch.isinf(m)].to(torch.bfloat16))
    exact = fin & ((C._bits(m) & 0xFFFF) == 0)
    assert torch.equal(r[exact].float(), m[exact]), "bf16-representable values are never moved"


def test_stochastic_rounding_is_unbiased():
    x = torch.tensor([1.0 + 2.0 ** -10, -3.0 - 2.0 ** -12, 1e-3, 7.77e-40, 12345.678]).repeat(40000, 1)
    r = C.round_bf16(x, stochastic=True, generator=torch.Generator().manual_seed(2)).double()
    spacing = (x.to(torch.bfloat16).double() - r).abs().amax(0).clamp(min=1e-300)
    err = (r.mean(0) - x[0].double()) / spacing
    # mean of 40000 draws: the standard error is at most half a spacing / 200
    assert (err.abs() < 0.01).all(), err
    assert not torch.equal(r.min(0).values, r.max(0).values), "both neighbours must occur"


def test_stochastic_rounding_reproduces_under_manual_seed():
    x = torch.randn(5000)
    torch.manual_seed(123)
    a = C.round_bf16(x, stochastic=True)
    torch.manual_seed(123)
    b = C.round_bf16(x, stochastic=True)
    c = C.round_bf16(x, stochastic=True)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(b.view(torch.int16), c.view(torch.int16))
    seed = C.draw_rounding_seed(torch.Generator().manual_seed(5))  # the generator draws the hash's seed
    rand = C.random_words(seed, 0, torch.arange(x.numel()))[0] & 0xFFFF
    assert torch.equal(C.stochastic_round_bf16(x, rand).view(torch.int16),
                       C.round_bf16(x, stochastic=True, generator=torch.Generator().manual_seed(5)).view(torch.int16))


# ------------------------------------------------------------------ int8 moments

def wide_range(n, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(n, generator=g) * 4)  # about 10 orders of magnitude
    if kind == "signed":
        return mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return mag


@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_int8_blockwise_error_bound(kind):
    x = wide_range(50 * C.BLOCK + 77, kind)  # a partial last block
    codes, scales = C.quantize(x, kind)
    assert codes.dtype == (torch.int8 if kind == "signed" else torch.uint8) and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (51,)
    back = C.dequantize(codes, scales, kind)
    xd, bd = x.double(), back.double()
    block_scale = scales.double().repeat_interleave(C.BLOCK)[: x.numel()]
    rounding = 2.0 ** -21  # the fp32 divide, multiply (and square) around the exact grid
    if kind == "signed":
        err = (bd - xd).abs()
        bound = 2.0 ** -4 * xd.abs() + 2.0 ** -18 * block_scale + rounding * xd.abs()
    else:
        err = (bd.sqrt() - xd.sqrt()).abs()
        bound = 2.0 ** -5 * xd.sqrt() + 2.0 ** -19 * block_scale + rounding * xd.sqrt()
    assert (err <= bound).all(), f"worst excess {(err / bound).max().item()}"
    assert (bd.sign() == xd.sign())[xd.abs() > 2.0 ** -17 * block_scale].all()
    # the largest element of every block is exact up to rounding
    blocks = x[: 50 * C.BLOCK].view(50, -1).abs()
    idx = blocks.argmax(1) + torch.arange(50) * C.BLOCK
    torch.testing.assert_close(back[idx].abs(), x[idx].abs(), rtol=2.0 ** -22, atol=0)


@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_int8_grid_points_round_trip(kind):
    mant, one = C._GRIDS[kind]
    k = torch.arange(0, one + 1)
    values = C._decode_unit(k, mant)
    assert (values[1:] > values[:-1]).all(), "the grid is strictly increasing"
    assert values[-1] == 1.0 and values[0] == 0.0
    assert torch.equal(C._encode_unit(values, mant), k)
    mid = (values[1:] + values[:-1]) / 2  # exact midpoints: ties go to the even code
    up = C._encode_unit(mid, mant)
    assert torch.equal(up % 2, torch.zeros_like(up))


def test_int8_special_blocks():
    x = torch.zeros(3 * C.BLOCK)
    x[C.BLOCK + 5] = float("nan")
    x[2 * C.BLOCK:] = torch.linspace(-1, 1, C.BLOCK)
    codes, scales = C.quantize(x, "signed")
    back = C.dequantize(codes, scales, "signed")
    assert torch.equal(back[: C.BLOCK], x[: C.BLOCK]), "an all-zero block stays zero"
    assert torch.isnan(back[C.BLOCK: 2 * C.BLOCK]).all(), "a block with a NaN decodes to NaN"
    assert torch.isfinite(back[2 * C.BLOCK:]).all()
    v = torch.zeros(C.BLOCK)
    v[3] = float("inf")
    assert torch.isnan(C.dequantize(*C.quantize(v, "sqrt"), "sqrt")).all()


@pytest.mark.parametrize("blockwise", ["int8", "int4"])
def test_state_round_trip_and_small_tensors_stay_fp32(blockwise):
    big = torch.randn(64, 80, dtype=torch.bfloat16)
    small = torch.randn(10, 10, dtype=torch.bfloat16)
    assert big.numel() >= C.SMALL_TENSOR_NUMEL > small.numel()
    for param in (big, small):
        fp32 = {"step": torch.tensor(7.0), "exp_avg": torch.randn(param.shape), "exp_avg_sq": torch.rand(param.shape),
                "max_exp_avg_sq": torch.rand(param.shape) + 1, "master_param": param.float() + 1e-4}
        st = C.encode_state(param.clone(), fp32, "split16", blockwise)
        keys = set(st)
        if param is big:
            assert {"exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "max_exp_avg_sq_scales", "master_low16"} <= keys
            assert "exp_avg" not in keys
            if blockwise == "int4":  # two codes per byte along the last dimension ([note: int4 packing])
                assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_codes"].shape == (64, 40)
        else:
            assert {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_low16"} <= keys
            assert st["exp_avg"].dtype == torch.float32
        p = param.clone()
        st = C.encode_state(p, fp32, "split16", torch.float32)
        back = C.decode_state(st, p)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
            assert torch.equal(back[key], fp32[key]), key
    with pytest.raises(ValueError, match="bfloat16"):  # the optimizer's check and error (_contract.check_master_weights)
        C.encode_state(torch.zeros(3, dtype=torch.float16), {"step": torch.tensor(0.0)}, "split16")
    with pytest.raises(ValueError, match="state_dtype"):
        C.init_state(torch.zeros(3), "fp32", torch.float16)


MODES = [(mw, sd) for mw in ("fp32", "split16", "split8", "none") for sd in (torch.float32, torch.bfloat16, "int8", "int4")]


@pytest.mark.parametrize("master_weights,state_dtype", MODES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_skipped_step_leaves_every_compact_buffer_bitwise(master_weights, state_dtype, stochastic):
    torch.manual_seed(0)
    param = torch.randn(70, 64).to(torch.bfloat16)
    state = C.init_state(param, master_weights, state_dtype, amsgrad=True)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True, stochastic_rounding=stochastic)
    C.compact_adamw_step_(param, torch.randn(70, 64), state, **hyper)  # non-trivial state first
    before = {k: v.clone() for k, v in state.items()}, param.clone()
    C.compact_adamw_step_(param, torch.full((70, 64), float("nan")), state, skip=torch.tensor(1.0), **hyper)
    for key, value in before[0].items():
        assert torch.equal(state[key].view(torch.uint8) if state[key].dim() else state[key], value.view(torch.uint8) if value.dim() else value), key
    assert torch.equal(param.view(torch.int16), before[1].view(torch.int16))
    C.compact_adamw_step_(param, torch.randn(70, 64), state, skip=torch.tensor(0.0), **hyper)
    assert state["step"] == 2 and not torch.equal(param.view(torch.int16), before[1].view(torch.int16))


# ------------------------------------------------------------------ checkpoints

def compact_state_dict():
    """A state dict as an optimizer with compact state writes it: one param per mode."""
    torch.manual_seed(0)
    params = [torch.randn(70, 64).to(torch.bfloat16), torch.randn(70, 64).to(torch.float16), torch.randn(5, 3),
              torch.randn(64, 70).to(torch.bfloat16), torch.randn(7).to(torch.bfloat16), torch.randn(64, 80).to(torch.bfloat16)]
    modes = [("split16", "int8"), ("split8", torch.bfloat16), ("fp32", "int8"), ("fp32", torch.float32), ("none", torch.bfloat16),
             ("split8", "int4")]
    states = {}
    for i, (p, (mw, sd)) in enumerate(zip(params, modes)):
        st = C.init_state(p, mw, sd, amsgrad=True)
        for _ in range(3):
            C.compact_adamw_step_(p, torch.randn(p.shape), st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True)
        states[i] = st
    groups = [{"params": [0, 1, 2], "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": True,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None},
              {"params": [3, 4, 5], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": True,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None}]
    return {"state": states, "param_groups": groups}, params


def test_to_torch_state_dict_loads_into_torch_adamw():
    from ampfused.checkpoint import to_torch_state_dict

    sd, params = compact_state_dict()
    snapshot = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    out = to_torch_state_dict(sd)
    for i, st in sd["state"].items():  # the input is not modified
        assert all(torch.equal(st[k].view(torch.uint8) if st[k].dim() else st[k], snapshot[i][k].view(torch.uint8)
                               if st[k].dim() else snapshot[i][k]) for k in st)
    for i, entry in out["state"].items():
        assert not any(C.is_compact_key(k) for k in entry)
        assert "master_param" not in entry or i == 3, "without params only stored fp32 masters survive"
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert entry[key].dtype == torch.float32 and entry[key].shape == params[i].shape
            assert torch.equal(entry[key], C.decode_state(sd["state"][i])[key])
    fp32_params = [p.float().requires_grad_() for p in params]
    opt = torch.optim.AdamW([{"params": fp32_params[:3]}, {"params": fp32_params[3:]}], foreach=False, amsgrad=True)
    opt.load_state_dict(out)
    for i, p in enumerate(fp32_params):
        assert torch.equal(opt.state[p]["exp_avg"], out["state"][i]["exp_avg"])
        p.grad = torch.randn(p.shape)
    opt.step()
    assert all(torch.isfinite(p).all() for p in fp32_params)


def test_to_torch_state_dict_with_params_gives_fp32_masters():
    from ampfused.checkpoint import to_torch_state_dict

    sd, params = compact_state_dict()
    out = to_torch_state_dict(sd, params)
    assert torch.equal(out["state"][0]["master_param"], C.join16(params[0], sd["state"][0]["master_low16"]))
    assert torch.equal(out["state"][1]["master_param"], C.join8(params[1], sd["state"][1]["master_residual8"]))
    assert torch.equal(out["state"][3]["master_param"], sd["state"][3]["master_param"])
    assert torch.equal(out["state"][5]["master_param"], C.join8(params[5], sd["state"][5]["master_residual8"]))
    for i in (0, 1, 3, 5):
        assert torch.equal(out["state"][i]["master_param"].to(params[i].dtype).view(torch.int16), params[i].view(torch.int16))
    assert "master_param" not in out["state"][2] and "master_param" not in out["state"][4]
    by_dict = to_torch_state_dict(sd, dict(enumerate(params)))
    assert torch.equal(by_dict["state"][0]["master_param"], out["state"][0]["master_param"])
    with pytest.raises(ValueError, match="state-dict order"):
        to_torch_state_dict(sd, params[::-1])
    with pytest.raises(ValueError, match="entries"):
        to_torch_state_dict(sd, params[:2])
    with pytest.raises(TypeError, match="optimizer state dict"):
        to_torch_state_dict({"exp_avg": 1})
