"""csrc/contract.h, the pass contract of the C++ and CUDA code, spells the same numbers as
``ampfused._contract``: stats slots, clip epsilon, group flags, dtype codes and the launch scratch
size (test_contract.py holds the Triton kernels' copies equal to the same module).

The header is read as text (`constexpr <type> kName = <value>;` lines), so this needs no build.
"""
import re
from pathlib import Path

import torch

from ampfused import _contract

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "contract.h"
CONSTANT = re.compile(r"^constexpr\s+[\w:]+\s+(k\w+)\s*=\s*([^;]+);", re.MULTILINE)


def header_constants() -> dict:
    """{kName: value} of the header's constants; a value is a number or a sum/product of numbers."""
    out = {}
    for name, text in CONSTANT.findall(HEADER.read_text()):
        expr = re.sub(r"(?<=[0-9.])f\b", "", text.strip())  # 1e-6f -> 1e-6
        assert re.fullmatch(r"[0-9eE.+\-*() ]+", expr), f"{name} = {text}: not a plain number"
        out[name] = eval(expr)  # digits and + - * ( ) only, checked above
    return out


def test_header_constants_equal_the_python_ones():
    k = header_constants()
    assert [k["kStatsNorm"], k["kStatsSkip"], k["kStatsFactor"], k["kStatsSumsq"], k["kStatsSize"]] == \
        [_contract.NORM, _contract.SKIP, _contract.FACTOR, _contract.SUMSQ, _contract.STATS_SIZE]
    assert k["kClipEps"] == _contract.CLIP_EPS
    assert (k["kFlagAmsgrad"], k["kFlagMaximize"]) == (_contract.FLAG_AMSGRAD, _contract.FLAG_MAXIMIZE)
    assert {torch.float32: k["kF32"], torch.float16: k["kF16"], torch.bfloat16: k["kBF16"]} == _contract.DTYPE_CODE
    assert k["kScratchBytes"] == _contract.SCRATCH_BYTES


def test_no_other_source_spells_the_contract():
    """The stats slots, flags and dtype codes are defined in contract.h only."""
    csrc = HEADER.parent
    defines = re.compile(r"constexpr[^;]*\bk(Stats(Norm|Skip|Factor|Sumsq|Size)|ClipEps|Flag(Amsgrad|Maximize)|F32|F16|BF16|ScratchBytes)\s*=|enum\s+DType\b")
    others = [p.relative_to(csrc) for p in csrc.rglob("*") if p.suffix in (".h", ".cpp", ".cu") and p != HEADER
              and defines.search(p.read_text())]
    assert not others, others
