"""One source for the facts the backends share: ``ampfused/_contract.py``.

``csrc/contract_generated.h`` (C++/CUDA), ``csrc/contract_aten_generated.h`` (its dtype tables over
ATen's ScalarType) and ``kernels/_contract_generated.py`` (Triton) are generated from it by
``csrc/generate_contract.py`` and committed. This regenerates them and fails when a committed file
is stale, and fails when any other source file defines or spells one of the facts itself (a
hand-written dtype-to-code mapping included). Read as text: no build, no triton import.
"""
import importlib.util
import re
from pathlib import Path

import pytest

from ampfused import _contract

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "csrc" / "generate_contract.py"
SOURCE_DIRS = ("ampfused", "kernels", "csrc", "benchmarks", "tests")
SUFFIXES = {".py", ".h", ".cpp", ".cu", ".cuh"}
# the definition, its generator and outputs, and this test (it spells the patterns)
EXEMPT = {ROOT / "ampfused" / "_contract.py", GENERATOR, ROOT / "csrc" / "contract_generated.h",
          ROOT / "csrc" / "contract_aten_generated.h", ROOT / "kernels" / "_contract_generated.py",
          Path(__file__).resolve()}


def generator():
    spec = importlib.util.spec_from_file_location("generate_contract", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_fresh():
    stale = [str(path.relative_to(ROOT)) for path, text in generator().render().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"stale, run `python csrc/generate_contract.py`: {stale}"


def test_contract_is_consistent():
    c = _contract
    assert sorted((c.NORM, c.SKIP, c.FACTOR, c.SUMSQ)) == list(range(c.STATS_SIZE))
    assert c.FLAG_AMSGRAD & c.FLAG_MAXIMIZE == 0
    lr_kinds = (c.LR_VALUE, c.LR_F32, c.LR_F16, c.LR_BF16, c.LR_F64, c.LR_SLOT)
    assert len(set(lr_kinds)) == len(lr_kinds)
    assert sorted(c.DTYPE_CODE.values()) == list(range(len(c.DTYPE_CODE)))
    assert sorted((c.MASTER_F32, c.MASTER_SPLIT16, c.MASTER_SPLIT8)) == [0, 1, 2]
    assert sorted((c.MOMENT_F32, c.MOMENT_BF16, c.MOMENT_INT8)) == [0, 1, 2]
    assert c.SCRATCH_STATS_COUNTER + 4 <= c.SCRATCH_UPDATE_COUNTER and c.SCRATCH_UPDATE_COUNTER + 4 <= c.SCRATCH_PARTIALS
    assert c.SCRATCH_BYTES == c.SCRATCH_PARTIALS + 16 * c.SCRATCH_BLOCKS
    assert c.SMALL_TENSOR_NUMEL % c.SCALE_BLOCK == 0
    assert c.SIGNED_ONE == (15 << c.SIGNED_MANT) and c.SQRT_ONE == (15 << c.SQRT_MANT)  # 1.0 is the top exponent
    for record in c.RECORDS:
        names = [f.name for f in getattr(c, record)]
        assert len(set(names)) == len(names), record
    assert set(c.SHARED) <= set(vars(c)) and len({v[0] for v in c.SHARED.values()}) == len(c.SHARED)
    assert sorted(c.LR_KIND_OF_DTYPE.values()) == sorted(set(lr_kinds) - {c.LR_VALUE, c.LR_SLOT})
    assert set(c.DTYPE_CODE) <= set(c.LR_KIND_OF_DTYPE)  # an lr in any kernel dtype is read as it is
    assert set(c.MASTER_PARAM_DTYPES) <= set(c.MASTER_ENCODINGS)
    assert all(set(dtypes) <= set(c.DTYPE_CODE) for dtypes in c.MASTER_PARAM_DTYPES.values())


def test_every_generated_file_is_checked():
    rendered = {path.relative_to(ROOT).as_posix() for path in generator().render()}
    assert rendered == {"csrc/contract_generated.h", "csrc/contract_aten_generated.h", "kernels/_contract_generated.py"}
    assert {ROOT / name for name in rendered} <= EXEMPT


def test_triton_columns_follow_the_record():
    pytest.importorskip("triton")
    from ampfused.kernels import _contract_generated as g

    for record, (_, prefix) in _contract.RECORDS.items():
        fields = [f.name for f in getattr(_contract, record) if f.triton]
        assert [int(getattr(g, prefix + name.upper())) for name in fields] == list(range(len(fields)))
        assert int(getattr(g, prefix + "SIZE")) == len(fields)


# ------------------------------------------------------------------ no other spelling

def _cpp_names():
    names = [cpp for cpp, _, _ in _contract.SHARED.values()]
    return names, [struct for struct, _ in _contract.RECORDS.values()]


def _py_names():
    names = list(_contract.SHARED) + list(generator()._triton_tables(_contract))  # constants and dtype tables
    for record, (_, prefix) in _contract.RECORDS.items():
        names += [prefix + f.name.upper() for f in getattr(_contract, record) if f.triton] + [prefix + "SIZE"]
    return names


def _alternatives(names):
    return "|".join(sorted(map(re.escape, names), key=len, reverse=True))


def _strip_cpp_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _strip_py_comments(text: str) -> str:
    return re.sub(r"#[^\n]*", "", text)


CPP_NAMES, CPP_STRUCTS = _cpp_names()
# the C++ names of the codes a dtype maps to (DTYPE_, LR_, MASTER_, MOMENT_)
CPP_CODES = [cpp for name, (cpp, _, _) in _contract.SHARED.items() if name.startswith(("DTYPE_", "LR_", "MASTER_", "MOMENT_"))]
HASH_CONSTANTS = [f"{getattr(_contract, name):X}" for name in _contract.SHARED if name.startswith("SR_")]
# how a message describes a master encoding: its dtype with its mode ("int16 (split16"), or what a split one holds
# ("split8 residuals"); in C++ master_description / kMasterDtypeNames say it (a mode's name alone is a label)
MASTER_WORDS = [r"%s\s*\(\s*%s\b" % (str(dtype).removeprefix("torch."), re.escape(mode))
                for mode, (dtype, _, _, _) in _contract.MASTER_ENCODINGS.items()]
MASTER_WORDS += [re.escape(_contract.MASTER_ENCODINGS[mode][3]) for mode in _contract.MASTER_PARAM_DTYPES]
# (what, pattern, which files, read without comments)
RULES = [
    ("defines a contract constant",
     re.compile(r"\b(?:constexpr|const|enum)\b[^;{}\n]*\b(?:%s)\s*=|#\s*define\s+(?:%s)\b"
                % (_alternatives(CPP_NAMES), _alternatives(CPP_NAMES))), "cpp", False),
    ("defines a contract record", re.compile(r"\bstruct\s+(?:%s)\s*\{" % _alternatives(CPP_STRUCTS)), "cpp", False),
    ("defines a contract constant or column",
     re.compile(r"^[ \t]*(?:\w+[ \t]*,[ \t]*)*(?:%s)(?:[ \t]*,[ \t]*\w+)*[ \t]*=(?!=)" % _alternatives(_py_names()),
                re.MULTILINE), "py", True),
    ("spells a stochastic-rounding hash constant",
     re.compile(r"0x0*(?:%s)(?![0-9A-Fa-f])" % "|".join(HASH_CONSTANTS), re.IGNORECASE), "all", False),
    ("spells the scratch size", re.compile(r"\b16\s*\+\s*16\s*\*\s*4096\b"), "all", False),
    ("spells the dtype codes", re.compile(r"\{\s*torch\.float32\s*:\s*0\s*[,}]"), "py", True),
    ("maps torch dtypes to codes by hand",
     re.compile(r"torch\.\w+\s*:\s*(?:int\(\s*)?(?:DTYPE|LR|MASTER|MOMENT)_[A-Z0-9]+\b"), "py", True),
    ("maps an ATen dtype to a code by hand (use contract_aten_generated.h)",
     re.compile(r"\b(?:at|c10)::(?:k[A-Z]\w*|ScalarType::\w+)\b[^;{}]*?\b(?:%s)\b" % _alternatives(CPP_CODES)), "cpp", True),
    ("describes a master encoding by hand (use master_description or kMasterDtypeNames)",
     re.compile(r'"[^"\n]*\b(?:%s)[^"\n]*"' % "|".join(MASTER_WORDS)), "cpp", True),
    ("compares a dtype code with a number", re.compile(r"\w*dtype\w*\s*==\s*[0-2]\b"), "all", True),
    ("spells a code grid", re.compile(r"\(\s*3\s*,\s*120\s*\)|\(\s*4\s*,\s*240\s*\)|tl\.constexpr\(\s*(?:120|240|256|4096)\s*\)"),
     "all", True),
    ("spells the int8 block size or the small-tensor cut", re.compile(r"(?://|%)\s*(?:256|4096)\b"), "py", True),
    ("spells the int8 block size or the small-tensor cut", re.compile(r"(?:/|%)\s*(?:256|4096)\b"), "cpp", True),
    ("spells the clip epsilon", re.compile(r"\+\s*1e-6f?\b"), "all", True),
]


def source_files():
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and path.resolve() not in EXEMPT:
                yield path


def test_the_scan_sees_the_sources():
    files = {p.relative_to(ROOT).as_posix() for p in source_files()}
    assert {"csrc/contract.h", "csrc/cuda/passes.cu", "csrc/cuda/compact_update.cuh", "ampfused/_args.py",
            "kernels/adamw.py"} <= files


def test_rules_catch_what_they_should():
    def hits(text, kind):
        out = []
        for what, pattern, where, strip in RULES:
            if where in ("all", kind):
                body = (_strip_py_comments if kind == "py" else _strip_cpp_comments)(text) if strip else text
                if pattern.search(body):
                    out.append(what)
        return out

    assert hits("constexpr int kStatsSkip = 1;", "cpp")
    assert hits("struct UpdateGroup {", "cpp")
    assert hits("LR_VALUE, LR_F32 = map(tl.constexpr, range(2))", "py")
    assert hits("    x = x * 0x21f0aaad", "py")
    assert hits("blocks = -(-p.numel() // 256)", "py")
    assert hits("if dtype_code == 1:", "py")
    assert hits("c = max_norm / (norm + 1e-6)", "py")
    assert hits("LR_KIND_OF = {torch.float32: int(LR_F32), torch.float64: int(LR_F64)}", "py")
    assert hits("DTYPE_CODE = {torch.float32: 0}", "py")  # a generated table's name, defined again
    assert hits("switch (t.scalar_type()) {\n    case at::kHalf: return kF16;", "cpp")
    assert hits("group.lr_kind = t == at::kDouble ? kLrF64 : kLrF32;", "cpp")
    assert hits("case c10::ScalarType::Short: return kMasterSplit16;", "cpp")
    assert hits('kind == kMasterSplit16 ? "int16 (split16 low halves)" : "int8 (split8 residuals)", ", which needs a ",', "cpp")
    assert hits('TORCH_CHECK(kind >= 0, "masters must be float32 (fp32 master) or int8 (split8)");', "cpp")
    assert not hits("TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == kStatsSize, \"stats\");", "cpp")
    assert not hits("const int32_t kind = exp_avg_kind_of(t.scalar_type());\nif (kind == kMomentInt8) {}", "cpp")
    assert not hits('"ampfused: masters[", i, "] is ", master_description(kind),\n", which needs a ", master_param_dtypes(kind)',
                    "cpp")
    assert not hits('// an int16 master holds split16 low halves\nif (t.master_kind == kMasterSplit16) {}', "cpp")
    assert not hits('{"split8 (fp16)", kMasterSplit8, kMomentF32, kF16, false},', "cpp")  # a label
    assert not hits("kind = EXP_AVG_KIND_OF_DTYPE.get(m.dtype, int(MOMENT_F32))", "py")
    assert not hits("x = SKIP + 1  # slot 256 // 256", "py")
    assert not hits("if lr_kind == LR_F16:\nfirst // SCALE_BLOCK", "py")
    assert not hits("// one scale per 256 elements\nstruct UpdateRange : UpdateTensor {", "cpp")


def test_no_other_source_spells_a_contract_fact():
    found = []
    for path in source_files():
        kind = "py" if path.suffix == ".py" else "cpp"
        text = path.read_text()
        stripped = (_strip_py_comments if kind == "py" else _strip_cpp_comments)(text)
        for what, pattern, where, strip in RULES:
            if where in ("all", kind):
                match = pattern.search(stripped if strip else text)
                if match:
                    found.append(f"{path.relative_to(ROOT)}: {what}: {match.group(0).strip()!r}")
    assert not found, "define these in ampfused/_contract.py and regenerate:\n" + "\n".join(found)
