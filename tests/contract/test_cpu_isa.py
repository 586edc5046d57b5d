"""The CPU backend's ISA variants (baseline, AVX2 + F16C, AVX-512, and the two vector ones' -div
twins that divide on the divider) give bitwise the same results, and the widest one the CPU has is
the one dispatched (its -div twin on AMD family 19h); AMPFUSED_CPU_ISA forces another.
(The AVX2 and AVX-512 variants agree in everything; the baseline agrees with them in accumulation,
stats and every fp16/bf16 conversion, and its update rounds where they fuse, see vector_only.)

Each variant runs in its own process (the choice is made once, when ampfused._C loads):
tests/contract/cpu_isa_worker.py runs the passes on fixed inputs and saves every output.
"""
import os
import subprocess
import sys

import pytest
import torch

from ampfused import _compiled

WORKER = os.path.join(os.path.dirname(__file__), "cpu_isa_worker.py")
pytestmark = pytest.mark.skipif(_compiled.load()[0] is None, reason="ampfused._C is not built")


def cpuinfo(key):
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def widest_isa(flags, vendor, family):
    divide = "-div" if vendor == ["AuthenticAMD"] and family == ["25"] else ""  # family 19h
    if {"avx2", "fma", "f16c"} <= flags:
        return ("avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else "avx2") + divide
    return "default"


RANK = {"default": 0, "avx2": 1, "avx2-div": 1, "avx512": 2, "avx512-div": 2}
FLAGS = set(cpuinfo("flags"))
WIDEST = widest_isa(FLAGS, cpuinfo("vendor_id"), cpuinfo("cpu family")) if FLAGS else None


def environment(isa):
    env = {k: v for k, v in os.environ.items() if k not in ("AMPFUSED_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    if isa is not None:
        env["AMPFUSED_CPU_ISA"] = isa
    return env


def run_worker(isa, tmp_path):
    out = tmp_path / f"{isa or 'auto'}.pt"
    proc = subprocess.run([sys.executable, WORKER, str(out)], env=environment(isa), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def flat_bits(value):
    """Every tensor in value, as raw bytes (NaN payloads and signed zeros count)."""
    if value is None:
        return [None]
    if isinstance(value, torch.Tensor):
        return [value.reshape(-1).contiguous().view(torch.uint8).clone()]
    if isinstance(value, (list, tuple)):
        return [b for x in value for b in flat_bits(x)]
    return [value]


def assert_keys_bitwise_equal(got, want, what, keys):
    for key in keys:
        for i, (a, b) in enumerate(zip(flat_bits(got[key]), flat_bits(want[key]))):
            if key.startswith("stats-bad"):  # the norm of non-finite grads: a NaN whose payload is the sum order's
                a, b = a.view(torch.float32), b.view(torch.float32)
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), f"{what}: {key}"
            elif isinstance(b, torch.Tensor):
                assert torch.equal(a, b), f"{what}: {key}[{i}] differs"
            else:
                assert a == b, f"{what}: {key}[{i}] differs"


def vector_only(key):
    """The update's math: the baseline build rounds a*b + c twice where the FMA builds fuse it, as
    ATen's default and AVX2 builds do (adamw_math.h), so only the F16C+FMA variants agree bitwise."""
    return key.startswith("upd-")


@pytest.mark.skipif(WIDEST is None, reason="no /proc/cpuinfo to read the CPU's flags from")
def test_widest_isa_is_dispatched_and_every_variant_is_bitwise_equal(tmp_path):
    auto = run_worker(None, tmp_path)
    assert auto["isa"] == WIDEST, f"CPU flags allow {WIDEST}, _C dispatched {auto['isa']}"
    for isa in ("base", "avx2", "avx2-div", "avx512", "avx512-div"):
        name = "default" if isa == "base" else isa
        if RANK[name] > RANK[WIDEST] or name == WIDEST:
            continue  # the CPU lacks it, or the automatic run is this variant
        forced = run_worker(isa, tmp_path)
        assert forced["isa"] == name
        keys = [k for k in auto if k != "isa" and (name != "default" or not vector_only(k))]
        assert_keys_bitwise_equal(forced, auto, f"{name} vs {WIDEST}", keys)
    # the write-back is torch's own conversion, NaN payloads included (F16C's, which torch uses on x86)
    for dtype in (torch.float16, torch.bfloat16):
        masters, params = auto[f"write-back-{dtype}"]
        for master, param in zip(masters, params):
            want = master.to(dtype)
            if dtype == torch.float16:
                assert torch.equal(param.view(torch.int16), want.view(torch.int16))
            else:  # c10::BFloat16 makes every NaN its canonical 0x7fc0, as do we
                same = (param.view(torch.int16) == want.view(torch.int16)) | (param.isnan() & want.isnan())
                assert bool(same.all())


def test_bad_isa_name_fails_the_import_and_says_why(tmp_path):
    # cwd outside the checkout: `python -c` would import the source tree's ampfused (no _C in a non-editable install)
    proc = subprocess.run([sys.executable, "-c", "import ampfused._C"], env=environment("avx3"), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert "AMPFUSED_CPU_ISA=avx3: use base, avx2, avx2-div, avx512 or avx512-div" in proc.stderr
