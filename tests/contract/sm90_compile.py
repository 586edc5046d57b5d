"""Compile every GPU kernel for sm_90 offline and check what only a GPU would show.

    python tests/contract/sm90_compile.py [--out docs/results/sm90-kernels.md] [--keep DIR]
        [--jobs N] [--cache DIR | --no-cache] [--no-cuda]          (exit 1 on a failed rule)

CI runs it as its own step after `pytest tests` (.ci/run), with TRITON_INTERPRET unset.
No GPU is needed. Triton: a fake active driver reports ``GPUTarget("cuda", 90, 32)`` and every
kernel launch of the real wrappers (``ampfused.kernels``, called on CPU tensors with the GPU block
sizes) goes through ``JITFunction.run`` as ``warmup``: the configurations compiled are exactly
those the code launches (constexprs, specialization of ints and pointer alignment, num_warps,
maxnreg, fp fusion), with ``EMULATE_FMA=False`` as on a GPU. Triton's ``jit_cache_hook`` takes
each specialization's data instead of compiling it there; each distinct one is compiled once
(``JITFunction.preload``) in a pool of ``--jobs`` worker processes (default: every core this
process may use), beside nvcc's jobs. Triton's ptxas reports with ``-v`` (ptxas runs once per
specialization); the SASS comes from Triton's cuobjdump. CUDA: ``csrc/cuda/passes.cu``
(ATen-free) with ``nvcc -arch=sm_90 -Xptxas -v`` when nvcc is found, and the probes of
``sm90_probes.cu``. What the rules read (PTX, ptxas report, SASS) is cached under ``--cache``
by a hash of the sources and the specialization ([note: compile cache]); the rules run on every
run, on cached artifacts as on fresh ones. Each specialization's compile time and the total are printed.
One source tree: the Triton kernels are imported from this checkout (ROOT, put first on sys.path
and checked), the same one whose csrc/ nvcc compiles; the script prints which, and the table says it.
The run fails unless it compiled the stats, update, scaler and accumulate kernels, the int4 update
variants beside their int8 twins, and, with nvcc, the CUDA update variants and the contraction probes.

Rules (each failure is printed; see [note: rules]):
  flags    no self-subtraction ``sub.f32 x, a, a`` in any PTX; the stats kernel tests the exponent
           bits (``and.b32 .., 2139095040``) of a value no fma produced; kernels compiled without fp
           fusion (update, scaler) have only ``.rn`` fp32/fp64 mul/add/sub, which ptxas never
           contracts; the scaler's PTX has no fma at all.
  spills   no local-memory load/store (LDL/STL) inside an innermost loop of the SASS (a backward
           branch with no other loop inside): loop-invariant scalars may spill, the streaming
           loops may not. Every update variant is compiled with and without WRITE_GRAD.
  vectors  every Triton update variant has an aligned block loop with 128-bit loads and stores, and
           no aligned block loop moves 8- or 16-bit scalars ([note: vector rule]).
  budget   registers and shared memory per kernel at most BUDGET below.
  pow      no ``__internal_accurate_pow`` in the CUDA update kernel.
  global   no generic LD/ST in the CUDA update and stats kernels: tensor data moves with LDG/STG
           ([note: global accesses] in csrc/cuda/compact_update.cuh); no LDS inside an innermost
           loop of the plain update variant (its record and scalars are read once, into registers;
           the compact variants read theirs from shared memory: [note: compact registers]).
  order    in the compact update variants' group loop (their largest innermost loop), every
           vector load of tensor data comes before the first store ([note: compact registers]).
  parity   each Triton update variant with int4 moments keeps at least its int8 twin's blocks per SM.
  flight   each update variant keeps at least MIN_BLOCKS blocks per SM, and its estimated share of
           HBM bandwidth (FLIGHT below) is at least MIN_SHARE.
  contract every probe of sm90_probes.cu has as many FFMA/DFMA with nvcc's default contraction as
           with --fmad=false (no product fused into a sum: [note: no contraction] in adamw_math.h),
           and the 1 - lr*wd probe has none at all.

Must run with TRITON_INTERPRET unset (exit 2 otherwise).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's ampfused, not an installed one: one source tree for both compilers
# registers per thread / static shared memory per block (bytes). The update kernel
# runs under maxnreg=72, every variant; the stats kernel holds 2-4 loads in flight a thread (see _runtime.py).
BUDGET = {"_grad_stats_kernel": (96, 16384), "_adamw_update_kernel": (72, 16384), "_scaler_update_kernel": (64, 1024),
          "_accumulate_kernel": (64, 16384), "stats_kernel": (64, 4096), "update_kernel": (64, 4096),
          "scaler_update_kernel": (64, 1024), "accumulate_kernel": (64, 1024)}
REGISTER_UNIT = 256  # sm_90 allocates a warp's registers in units of 256
SM90 = dict(regs=65536, threads=2048, blocks=32, smem=233472, smem_reserved=1024)

# [note: bytes in flight] Little's law: to sustain bandwidth B with latency L, B * L bytes must be
# in flight. H200: HBM3e at ~4.8 TB/s over 132 SMs is ~36 B/ns per SM; with ~700 ns of loaded DRAM
# latency (an assumption: ~500 ns idle, more under load) an SM needs ~25.5 KB of loads in flight.
# A thread has in flight the loads it issues before its first store (which waits on them): FLIGHT
# gives, per update variant, that count for a representative tensor (bytes per thread per loop
# iteration, from the kernel's code: 4 elements a part; the compact variants load both parts first,
# which the `order` rule checks in their SASS); blocks per SM come from the compiled registers.
HBM = dict(bytes_per_s=4.8e12, sms=132, latency_s=700e-9)
FLIGHT = {  # variant: (representative tensor, bytes a thread has in flight)
    "plain": ("fp32 param, grad and moments", 4 * (4 + 4 + 4 + 4)),
    "compact": ("bf16 param, split16 master, bf16 grad, fp32 moments; both parts", 8 * (2 + 2 + 2 + 4 + 4)),
    "compact + int8 moments": ("bf16 param, split16 master, bf16 grad, int8 moments; both parts", 8 * (2 + 2 + 2 + 1 + 1)),
}
MIN_BLOCKS = {"plain": 2, "compact": 1, "compact + int8 moments": 1}  # [note: update occupancy] in passes.cu
MIN_SHARE = 1.0


def flight(variant: str, blocks: int, threads: int) -> tuple[int, float]:
    """Bytes in flight per SM and the estimated fraction of HBM bandwidth they sustain."""
    needed = HBM["bytes_per_s"] / HBM["sms"] * HBM["latency_s"]
    in_flight = FLIGHT[variant][1] * threads * blocks
    return in_flight, min(1.0, in_flight / needed)


def occupancy(regs: int, threads: int, smem: int) -> tuple[int, float]:
    """Resident blocks per SM on sm_90 and the fraction of its 64 warps they fill."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_regs = SM90["regs"] // (regs_per_warp * warps)
    by_threads = SM90["threads"] // (warps * 32)
    by_smem = SM90["smem"] // (smem + SM90["smem_reserved"])
    blocks = min(SM90["blocks"], by_regs, by_threads, by_smem)
    return blocks, blocks * warps / 64


def ptxas_info(text: str) -> dict[str, dict]:
    """Parse ``ptxas -v``: {mangled name: {regs, spill_stores, spill_loads, smem, stack}}."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            out[name] = dict(regs=0, spill_stores=0, spill_loads=0, smem=0, stack=0)
            continue
        if name is None:
            continue
        if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        if m := re.search(r"Used (\d+) registers", line):
            out[name]["regs"] = int(m.group(1))
        if m := re.search(r"(\d+) bytes smem", line):
            out[name]["smem"] = int(m.group(1))
    return out


def sass_functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    funcs, current = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2)))
    return funcs


def spills_in_inner_loops(instructions: list[tuple[int, str]]) -> list[str]:
    """LDL/STL inside an innermost loop: [target, branch] of a backward BRA containing no other."""
    loops = []
    for addr, text in instructions:
        m = re.search(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    inner = [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    return [f"{addr:#x} {text}" for addr, text in instructions
            if re.search(r"\b(LDL|STL)\b", text) and any(a <= addr <= b for a, b in inner)]


def flag_rules(name: str, ptx: str, fused: bool) -> list[str]:
    """[note: rules] The PTX checks of the docstring, for one Triton kernel."""
    problems = []
    for line in ptx.splitlines():
        m = re.match(r"\s*sub(?:\.\w+)*\.f(?:32|64)\s+(%\w+),\s*(%\w+),\s*(%\w+);", line)
        if m and m.group(2) == m.group(3):
            problems.append(f"{name}: self-subtraction (an identity a compiler may contract): {line.strip()}")
    if not fused:
        loose = [l.strip() for l in ptx.splitlines() if re.match(r"\s*(mul|add|sub)\.f(32|64)\s", l)]
        if loose:
            problems.append(f"{name}: compiled without fp fusion but has contractible ops: {loose[:3]}")
    if name == "_scaler_update_kernel" and re.search(r"\bfma\.", ptx):
        problems.append(f"{name}: an fma in a kernel that has nothing to fuse")
    if name == "_grad_stats_kernel":
        defs = {}
        for line in ptx.splitlines():
            m = re.match(r"\s*([\w.]+)\s+(%\w+),\s*(%\w+)?", line)
            if m:
                defs[m.group(2)] = (m.group(1), m.group(3))

        def produced_by_fma(reg, depth=4):  # through selp/mov to the arithmetic that made the value
            op, src = defs.get(reg, ("", None))
            if op.startswith("fma"):
                return True
            return depth > 0 and op.startswith(("selp", "mov")) and src is not None and produced_by_fma(src, depth - 1)

        # the exponent test as written, or as LLVM canonicalizes it: (bits & 0x7FFFFFFF) > 0x7F7FFFFF
        tests = re.findall(r"and\.b32\s+%\w+,\s*(%\w+),\s*(?:2139095040|2147483647);", ptx)
        if not tests or "2139095039" not in ptx and "2139095040" not in ptx:
            problems.append(f"{name}: no exponent-bit test (bits & 0x7F800000) for the non-finite flag")
        fed = [r for r in tests if produced_by_fma(r)]
        if fed:
            problems.append(f"{name}: the non-finite test reads an fma result ({fed[:3]}): a contracted product")
    return problems


# ------------------------------------------------------------------------------------------ Triton

def install_fake_driver():
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class OfflineSm90(CudaDriver):
        def __init__(self):  # no libcuda: nothing is initialised
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        @staticmethod
        def is_active():
            return True

    triton.runtime.driver.set_active(OfflineSm90())


def enumerate_triton() -> list[dict]:
    """Every distinct specialization the real wrappers launch, in launch order, none compiled here.

    Each launch goes through ``JITFunction.run`` as warmup (``EMULATE_FMA=False``, as on a CUDA
    device); Triton's ``jit_cache_hook`` receives what it would compile (the specialization data
    ``JITFunction.preload`` takes back) and declines the compile. A launch whose Triton key (the
    specialization of every argument and the options) was met before adds nothing: each distinct
    specialization is compiled once, by ``compile_one`` in a worker."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    specs: dict[tuple, dict] = {}
    launch: dict = {}
    launches = [0]
    original_run = JITFunction.run

    def warmup_instead(self, *args, grid, warmup, **kwargs):
        if "EMULATE_FMA" in kwargs:
            kwargs["EMULATE_FMA"] = False  # what a CUDA device launches
        launches[0] += 1
        launch.update(config=", ".join(f"{k}={v}" for k, v in kwargs.items() if k.isupper()),
                      fused=kwargs.get("enable_fp_fusion", True))
        return original_run(self, *args, grid=grid, warmup=True, **kwargs)

    def record(key, fn, compile, **_):
        jit = fn.jit_function
        specs.setdefault((fn.name, str(key)), dict(
            name=jit.fn.__name__, module=fn.module, qualname=fn.name, source_key=jit.cache_key,
            data=compile["specialization_data"], **launch))
        return True  # compiled later, once, in a worker

    JITFunction.run, knobs.runtime.jit_cache_hook = warmup_instead, record
    try:
        launch_everything()
    finally:
        JITFunction.run, knobs.runtime.jit_cache_hook = original_run, None
    print(f"triton: {launches[0]} launches, {len(specs)} distinct specializations", flush=True)
    return list(specs.values())


def launch_everything():
    """The launches of the real wrappers, on CPU tensors with the GPU block sizes."""
    import torch
    from ampfused._batch import Batch, Hyper
    from ampfused.kernels import _runtime, accumulate, adamw, scaler, stats

    assert not _runtime.INTERPRET, "TRITON_INTERPRET is set: these would be interpreter sizes"
    numels = [50257 * 768, 768, 3 * 768 * 768, 4097]  # big (many chunks), small, odd tail
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.ones(n, dtype=dtype) for n in numels]
        for has_scale, has_found, clip in ((False, False, None), (True, False, 1.0), (True, True, None), (False, False, 1.0)):
            stats.grad_stats_(Batch.of_grads(grads), torch.ones(()) if has_scale else None, torch.zeros(()) if has_found else None,
                              clip, torch.zeros(4))
    params = [torch.zeros(n) for n in numels]
    fp32 = lambda: [torch.zeros(n) for n in numels]  # noqa: E731
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
    for grad_scale in (None, torch.ones(())):
        adamw.adamw_update_(Batch(params, fp32(), fp32(), fp32(), [None] * 4, [torch.zeros(()) for _ in numels],
                                  [None] * 4, [0] * 4, [hyper]), torch.zeros(4), grad_scale=grad_scale)
    compact_updates(adamw, hyper, numels)
    for min_scale in (None, 1.0):
        scaler.scaler_update_(torch.zeros(()), torch.ones(()), torch.zeros((), dtype=torch.int32),
                              torch.ones((), dtype=torch.int32), torch.zeros((), dtype=torch.int64),
                              torch.zeros((), dtype=torch.int64), torch.zeros(2, dtype=torch.float64),
                              growth_factor=1.5, backoff_factor=0.3, growth_interval=2000, hysteresis=1, min_scale=min_scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        accumulate.accumulate_(torch.zeros(1 << 20), torch.zeros(1 << 20, dtype=dtype))


def triton_cache_key(spec: dict) -> str:
    """[note: compile cache] Triton's own cache key, less its per-file paths: Triton's build, the
    kernel's source hash (its own source, every @triton.jit function it calls and the global
    constexprs it reads, as ``JITFunction.cache_key`` hashes them), the specialization and options,
    and the tools that made the artifacts."""
    import triton
    from triton.runtime.cache import triton_key

    data = spec["data"].replace(str(Path(triton.__file__).parent), "<triton>")  # libdevice's path: not a new virtual environment's
    return hashlib.sha256("\n".join([CACHE_FORMAT, triton_key(), triton.__version__, spec["qualname"], spec["source_key"],
                                      data, tool_versions()]).encode()).hexdigest()


_DRIVER = [False]


def _set_env(name: str, value: str) -> None:  # a worker's initializer
    os.environ[name] = value


def compile_one(spec: dict, cache: Path | None) -> dict:
    """One specialization (a worker's job): Triton's compile (its ptxas run with ``-v``, whose report
    is kept: ptxas runs once), the SASS by cuobjdump; the artifacts from the cache when its key is
    there. The rules read the artifacts afterwards, cached or not."""
    key = triton_cache_key(spec)
    if cache is not None and (hit := cache_get(cache / "triton" / key)) is not None:
        return dict(hit, cached=True, compile_s=0.0, tools_s=0.0)
    if not _DRIVER[0]:
        install_fake_driver()
        _DRIVER[0] = True
    import contextlib
    import importlib
    import io

    from triton import knobs

    jit = importlib.import_module(spec["module"])
    for part in spec["qualname"].split("."):
        jit = getattr(jit, part)
    log = io.StringIO()
    start, cpu_start = time.perf_counter(), cpu_seconds()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # Triton prints its ptxas -v report
        kernel = jit.preload(spec["data"])
    compile_s, compile_cpu_s = time.perf_counter() - start, cpu_seconds() - cpu_start
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        ptxas_log = log.getvalue()
        if "Used " not in ptxas_log:  # Triton's ptxas did not run or said nothing: run it once more
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(kernel.asm["ptx"])
            ptxas_log = run_tool([tool("ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "scratch.cubin")])
        sass = run_tool([tool("cuobjdump"), "-sass", str(cubin)])
    tools_s = time.perf_counter() - start - compile_s
    out = dict(ptx=kernel.asm["ptx"], ptxas_log=ptxas_log, sass=sass,
               meta=dict(hash=kernel.hash, num_warps=kernel.metadata.num_warps, shared=kernel.metadata.shared,
                         compile_s=compile_s, compile_cpu_s=compile_cpu_s, tools_s=tools_s))
    if cache is not None:
        cache_put(cache / "triton" / key, out)
    return dict(out, cached=False, compile_s=compile_s, compile_cpu_s=compile_cpu_s, tools_s=tools_s)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): a compile's cost on an idle core,
    whatever else the machine runs meanwhile (its wall time grows with the load; this does not, much)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def analyze_triton(specs: list[dict], artifacts: list[dict]) -> tuple[list[dict], list[str]]:
    """The rules on every specialization's artifacts, in launch order."""
    rows, problems, seen = [], [], set()
    for i, (entry, art) in enumerate(zip(specs, artifacts)):
        key = (entry["name"], art["meta"]["hash"])
        if key in seen:
            continue
        seen.add(key)
        info = next(iter(ptxas_info(art["ptxas_log"]).values()))
        instructions = next(iter(sass_functions(art["sass"]).values()))
        inner = spills_in_inner_loops(instructions)
        threads = art["meta"]["num_warps"] * 32
        smem = max(info["smem"], art["meta"]["shared"])
        rows.append(dict(kernel=entry["name"], config=entry["config"], threads=threads, **info, smem_total=smem,
                         inner_spills=len(inner), occupancy=occupancy(info["regs"], threads, smem),
                         compile_s=(art["meta"]["compile_s"], art["meta"].get("compile_cpu_s", float("nan")))))
        problems += flag_rules(entry["name"], art["ptx"], entry["fused"])
        problems += [f"{entry['name']} [{entry['config']}]: spill in a hot loop: {s}" for s in inner]
        problems += budget_problems(entry["name"], info["regs"], smem, entry["config"])
        if entry["name"] == "_adamw_update_kernel":
            packed = PACKED_CODE_TENSORS if "CODE_BITS=4" in entry["config"] or "CODE_BITS=12" in entry["config"] else 0
            rows[-1]["vectors"], vector_problems = full_block_vectors(instructions, packed)
            problems += [f"{entry['name']} [{entry['config']}]: {p}" for p in vector_problems]
        if KEEP is not None:
            (KEEP / f"triton{i}_{entry['name']}.sass").write_text("\n".join(f"/*{a:04x}*/ {t}" for a, t in instructions))
            (KEEP / f"triton{i}_{entry['name']}.ptx").write_text(art["ptx"])
    return rows, problems + int4_parity(rows)


def int4_parity(rows: list[dict]) -> list[str]:
    """[note: int4 parity] Each Triton update variant with int4 moments (and no int8 ones) keeps at
    least the blocks per SM of its int8 twin, the same launch with int8 moments (issue 35: 4-bit
    moments may not cost occupancy); the twin's count goes into the row for the table."""
    update = {r["config"]: r for r in rows if r["kernel"] == "_adamw_update_kernel"}
    problems = []
    for config, row in update.items():
        if "CODE_BITS=4" not in config:
            continue
        twin = update.get(config.replace("CODE_BITS=4", "CODE_BITS=8"))
        if twin is None:
            problems.append(f"_adamw_update_kernel [{config}]: no int8 twin compiled to compare blocks per SM with")
            continue
        row["int8_twin"] = twin
        if row["occupancy"][0] < twin["occupancy"][0]:
            problems.append(f"_adamw_update_kernel [{config}]: {row['occupancy'][0]} blocks per SM < its int8 twin's "
                            f"{twin['occupancy'][0]} ([note: int4 parity])")
    return problems


def parity_table(rows: list[dict]) -> str:
    rows = [r for r in rows if "int8_twin" in r]
    if not rows:
        return ""
    lines = ["int4 moments against int8 ([note: int4 parity]): the update variants' registers and blocks per SM.", "",
             "| config (int4) | regs int4 / int8 | blocks/SM int4 / int8 |", "|---|---:|---:|"]
    for r in rows:
        config = r["config"].replace("BLOCK=512, CHUNK=8192, TABLE_BLOCK=1024, EMULATE_FMA=False, ", "")
        lines.append(f"| {config} | {r['regs']} / {r['int8_twin']['regs']} "
                     f"| {r['occupancy'][0]} / {r['int8_twin']['occupancy'][0]} |")
    return "\n".join(lines)


KEEP: Path | None = None  # --keep: where the Triton kernels' PTX and SASS are written


def global_access(text: str) -> tuple[str, int, bool] | None:
    """(LDG or STG, bits a thread moves, predicated) of a global access, else None."""
    m = re.match(r"(@!?U?P\w+\s+)?(LDG|STG)\.E((?:\.\w+)*)", text)
    if not m:
        return None
    mods = set(m.group(3).split("."))
    bits = 128 if "128" in mods else 64 if "64" in mods else 16 if mods & {"U16", "S16"} else 8 if mods & {"U8", "S8"} else 32
    return m.group(2), bits, m.group(1) is not None


# int4 codes: a thread's 4 elements are 2 bytes, which it moves in one 16-bit access ([note: int4
# blocks] in kernels/_compact_state.py): at most one load and one store per code tensor of a block
PACKED_CODE_TENSORS = 3  # exp_avg, exp_avg_sq, max_exp_avg_sq


def full_block_vectors(instructions: list[tuple[int, str]], packed: int = 0) -> tuple[dict[str, int], list[str]]:
    """[note: vector rule] The update's aligned full-block loops and the width of their accesses.

    The block loops are the innermost loops that move tensor data (a tail block runs once, outside
    them); an aligned one moves 128 bits somewhere, while an unaligned tensor's loop moves every
    element alone. A thread owns 4 consecutive elements of every tensor: fp32 moves as 128-bit,
    16-bit as 64-bit, int8 codes as 32-bit and packed int4 codes as 16-bit accesses (branches of the
    dtype codes may predicate them). The rule: each variant has an aligned block loop with 128-bit
    loads and stores, and no aligned loop moves 8- or 16-bit scalars (a tensor that lost its
    vectors, as every tensor of an int8-moment launch did when the int8 blocks were 2-D tiles
    without contiguity hints), but for ``packed`` 16-bit loads and as many stores of int4 codes."""
    counts = {f"{op}.{bits}": 0 for op in ("LDG", "STG") for bits in (128, 64, 32, 16, 8)}
    counts["loops"] = 0
    problems = []
    for a, b in innermost_loops(instructions):
        accesses = [x for addr, text in instructions if a <= addr <= b and (x := global_access(text))]
        if not any(bits == 128 for _, bits, _ in accesses):
            continue
        counts["loops"] += 1
        for op, bits, _ in accesses:
            counts[f"{op}.{bits}"] += 1
        widths = [f"{op}.{bits}" for op, bits, _ in accesses]
        scalars = [w for w in widths if w.endswith(".8") or w.endswith(".16") and widths.count(w) > packed]
        if scalars:
            problems.append(f"aligned block loop {a:#x}-{b:#x} moves {len(scalars)} 8/16-bit scalars "
                            f"({', '.join(sorted(set(scalars)))}): a tensor lost its vector accesses")
    if not counts["LDG.128"] or not counts["STG.128"]:
        problems.append(f"no 128-bit load and store in any block loop ({counts['loops']} aligned loops): "
                        "the tensors move with scalar accesses ([note: vector rule])")
    return counts, problems


def compact_updates(adamw, hyper, numels):
    """The update's compact variants (DESIGN §9): split16 alone (the most common), bf16 moments with
    stochastic rounding, split8 with bf16 moments, int8 moments, int4 moments under each master an
    optimizer gives them (split16, split8, none with stochastic rounding), and every encoding in one
    launch. An optimizer has one master mode and one state_dtype, so int4 meets no other master or
    moment encoding in its launches but fp32 (small tensors); the launch of every encoding with int4
    in int8's place spills in its block loops (reachable only through hand-built lists)."""
    import torch
    from ampfused._batch import Batch
    from ampfused._contract import SCALE_BLOCK, MASTER_ENCODINGS, packed_shape

    def tensors(param_dtype, master_dtype, state_dtype, n):
        n += n % 2 if state_dtype == "int4" else 0  # [note: int4 packing]: pairs of elements
        p = torch.zeros(n, dtype=param_dtype)
        master = None if master_dtype is None else torch.zeros(n, dtype=master_dtype)
        if state_dtype in ("int8", "int4"):
            codes = (n,) if state_dtype == "int8" else packed_shape((n,))
            moments = [torch.zeros(codes, dtype=torch.int8 if state_dtype == "int8" else torch.uint8),
                       torch.zeros(codes, dtype=torch.uint8)]
            blocks = -(-n // SCALE_BLOCK)
            scales = (torch.zeros(blocks), torch.zeros(blocks), None)
        else:
            moments, scales = [torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)], None
        return p, torch.zeros(n), moments, master, scales

    def launch(configs, seed=None, grad_scale=None):
        rows = [tensors(*config, n) for config, n in zip(configs, numels)]
        adamw.adamw_update_(Batch([r[0] for r in rows], [r[1] for r in rows], [r[2][0] for r in rows], [r[2][1] for r in rows],
                                  [None] * len(rows), [torch.zeros(()) for _ in rows], [r[3] for r in rows], [0] * len(rows),
                                  [hyper], [r[4] for r in rows]), torch.zeros(4), rounding_seed=seed, grad_scale=grad_scale)

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    split16 = MASTER_ENCODINGS["split16"][0]  # the stored dtype of its low halves
    mixed = [(bf16, split16, "int8"), (fp32, None, fp32), (bf16, None, bf16), (fp16, torch.int8, fp32)]
    for grad_scale in (None, torch.ones(())):  # WRITE_GRAD: a GradScaler step also stores the unscaled grads
        launch([(bf16, split16, fp32)] * 4, grad_scale=grad_scale)
        launch([(bf16, None, bf16)] * 4, seed=1, grad_scale=grad_scale)
        launch([(bf16, split16, bf16)] * 4, seed=1, grad_scale=grad_scale)
        launch([(fp16, torch.int8, bf16)] * 4, grad_scale=grad_scale)
        for blockwise in ("int8", "int4"):  # each int4 variant beside its int8 twin ([note: int4 parity])
            launch([(bf16, split16, blockwise)] * 4, grad_scale=grad_scale)
            launch([(bf16, torch.int8, blockwise)] * 4, grad_scale=grad_scale)
            launch([(bf16, None, blockwise)] * 4, seed=1, grad_scale=grad_scale)
        launch(mixed, seed=1, grad_scale=grad_scale)


# -------------------------------------------------------------------------------------------- CUDA

def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc")), None)


MEMORY_OPS = ("LDG", "STG", "LD", "ST", "LDS")


def memory_counts(instructions: list[tuple[int, str]]) -> dict[str, int]:
    counts = dict.fromkeys(MEMORY_OPS, 0)
    for _, text in instructions:
        m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9]+)\b", text)
        if m and m.group(1) in counts:
            counts[m.group(1)] += 1
    return counts


def innermost_loops(instructions: list[tuple[int, str]]) -> list[tuple[int, int]]:
    loops = []
    for addr, text in instructions:
        m = re.search(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    return [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]


def load_store_order(instructions: list[tuple[int, str]]) -> list[str]:
    """In the group loop (the largest innermost loop of a compact variant): vector LDGs after the first STG."""
    loops = innermost_loops(instructions)
    if not loops:
        return ["no innermost loop (the rule cannot see the group loop)"]
    a, b = max(loops, key=lambda loop: loop[1] - loop[0])
    body = [(addr, text) for addr, text in instructions if a <= addr <= b]
    # global or generic (the `global` rule asks for the former; this one holds for either)
    stores = [addr for addr, t in body if re.match(r"(?:@!?P\w+\s+)?STG?\.E\b", t)]
    vector_loads = [addr for addr, t in body if re.match(r"(?:@!?P\w+\s+)?LDG?\.E\.(64|128)\b", t)]
    if not stores or not vector_loads:
        return [f"group loop {a:#x}-{b:#x}: no store or no vector load (the rule cannot see the loop)"]
    return [f"group loop: a vector load at {addr:#x} after the first store ({stores[0]:#x})"
            for addr in vector_loads if addr > stores[0]]


def cuda_sources() -> list[Path]:
    """What nvcc reads: every source under csrc/ and the probes."""
    return sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".hpp", ".cpp")) \
        + [ROOT / "tests/contract/sm90_probes.cu"]


def cuda_cache_key(job: str, nvcc: str) -> str:
    """[note: compile cache] for nvcc: the sources it reads, nvcc's release and path, the job."""
    digest = hashlib.sha256("\n".join([CACHE_FORMAT, job, run_tool([nvcc, "--version"]), tool_versions()]).encode())
    for path in cuda_sources():
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def nvcc_job(job: str, nvcc: str, cache: Path | None) -> dict:
    """One nvcc job (a worker's): ``passes`` (csrc/cuda/passes.cu with ptxas -v and its PTX) or
    ``probes`` (sm90_probes.cu with and without contraction); the artifacts the rules read, cached."""
    key = cuda_cache_key(job, nvcc)
    if cache is not None and (hit := cache_get(cache / "cuda" / key)) is not None:
        return dict(hit, cached=True, compile_s=0.0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if job == "passes":
            cubin, keep = work / "passes.cubin", work / "keep"
            keep.mkdir()
            log = run_tool([nvcc, "-arch=sm_90", "-O3", "-std=c++17", f"-I{ROOT / 'csrc'}", "-Xptxas", "-v", "-cubin", "--keep",
                            f"--keep-dir={keep}", str(ROOT / "csrc/cuda/passes.cu"), "-o", str(cubin)])
            out = dict(ptxas_log=log, sass=run_tool([tool("cuobjdump"), "-sass", str(cubin)]),
                       ptx="\n".join(p.read_text() for p in sorted(keep.glob("*.ptx"))))
        else:
            out = {}
            for fmad in ("true", "false"):
                cubin = work / f"probes_{fmad}.cubin"
                run_tool([nvcc, "-arch=sm_90", "-O3", "-std=c++17", f"-I{ROOT / 'csrc'}", f"--fmad={fmad}", "-cubin",
                          str(ROOT / "tests/contract/sm90_probes.cu"), "-o", str(cubin)])
                out[f"sass_fmad_{fmad}"] = run_tool([tool("cuobjdump"), "-sass", str(cubin)])
    compile_s = time.perf_counter() - start
    out["meta"] = dict(compile_s=compile_s)
    if cache is not None:
        cache_put(cache / "cuda" / key, out)
    return dict(out, cached=False, compile_s=compile_s)


def analyze_cuda(art: dict) -> tuple[list[dict], list[str]]:
    log, ptx = art["ptxas_log"], art["ptx"]
    sass = sass_functions(art["sass"])
    rows, problems = [], []
    for mangled, info in ptxas_info(log).items():
        name = next(n for n in ("scaler_update_kernel", "accumulate_kernel", "update_kernel", "stats_kernel") if n in mangled)
        threads = 1 if name == "scaler_update_kernel" else 512
        instructions = sass.get(mangled, [])
        inner = spills_in_inner_loops(instructions)
        config = {"INS_8BFloat16": "bf16", "INS_4Half": "fp16", "IfE": "fp32",  # accumulate's grad dtype
                  "ILi0E": "plain", "ILi1E": "compact", "ILi2E": "compact + int8 moments"}  # update's variant
        dtype = next((v for k, v in config.items() if k in mangled), "")
        memory = memory_counts(instructions)
        loop_lds = sum(1 for a, b in innermost_loops(instructions) for addr, t in instructions
                       if a <= addr <= b and re.match(r"(?:@!?P\w+\s+)?LDS\b", t))
        row = dict(kernel=f"{name} (CUDA)", config=dtype, threads=threads, **info, smem_total=info["smem"],
                   inner_spills=len(inner), occupancy=occupancy(info["regs"], threads, info["smem"]), memory=memory,
                   loop_lds=loop_lds)
        rows.append(row)
        problems += [f"{name} (CUDA): spill in a hot loop: {s}" for s in inner]
        problems += budget_problems(name, info["regs"], info["smem"], dtype)
        if name in ("update_kernel", "stats_kernel") and (memory["LD"] or memory["ST"]):
            problems.append(f"{name} [{dtype}] (CUDA): {memory['LD']} generic LD / {memory['ST']} generic ST "
                            "(tensor data must move with LDG/STG: [note: global accesses])")
        if name == "update_kernel":
            if loop_lds and dtype == "plain":  # the compact variants read theirs in shared ([note: compact registers])
                problems.append(f"update_kernel [{dtype}] (CUDA): {loop_lds} LDS inside innermost loops "
                                "(the record and scalars are read once, before the loop)")
            blocks = row["occupancy"][0]
            row["flight"] = flight(dtype, blocks, threads)
            if blocks < MIN_BLOCKS[dtype]:
                problems.append(f"update_kernel [{dtype}] (CUDA): {blocks} blocks per SM < {MIN_BLOCKS[dtype]}")
            if row["flight"][1] < MIN_SHARE:
                problems.append(f"update_kernel [{dtype}] (CUDA): {row['flight'][0]} B in flight per SM sustain "
                                f"~{row['flight'][1]:.0%} of HBM bandwidth < {MIN_SHARE:.0%} ([note: bytes in flight])")
            if dtype != "plain":
                problems += [f"update_kernel [{dtype}] (CUDA): {p}" for p in load_store_order(instructions)]
    if "__internal_accurate_pow" in ptx:
        problems.append("passes.cu: __internal_accurate_pow is still compiled in (bias corrections per element)")
    if not ptx:
        problems.append("passes.cu: nvcc --keep left no PTX to check")
    return rows, problems


def analyze_probes(art: dict) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """[note: contraction probes] FFMA/DFMA per probe kernel, with nvcc's default contraction and without."""
    counts = {}
    for fmad in ("true", "false"):
        for name, instructions in sass_functions(art[f"sass_fmad_{fmad}"]).items():
            n = sum(1 for _, t in instructions if re.match(r"(?:@!?P\w+\s+)?[DF]FMA\b", t))
            counts.setdefault(name, [0, 0])[0 if fmad == "true" else 1] = n
    problems = [f"{name}: {a} FFMA/DFMA with nvcc's default contraction, {b} with --fmad=false: a product fused "
                "into a sum ([note: no contraction] in csrc/adamw_math.h)" for name, (a, b) in sorted(counts.items()) if a != b]
    if "probe_scalars_decay" not in counts:
        problems.append("sm90_probes.cu: no probe_scalars_decay kernel")
    elif counts["probe_scalars_decay"][0]:
        problems.append(f"probe_scalars_decay: {counts['probe_scalars_decay'][0]} FFMA/DFMA in 1 - lr*wd")
    return {k: tuple(v) for k, v in counts.items()}, problems


# ------------------------------------------------------------------------------------------ common

# [note: compile cache] An entry holds what the rules read (PTX, ptxas -v report, SASS), never a
# verdict: every run evaluates every rule on the artifacts, cached or fresh. Its key hashes all that
# made them (Triton: triton_cache_key; nvcc: cuda_cache_key); CACHE_FORMAT changes with the layout.
CACHE_FORMAT = "sm90-artifacts-1"


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ampfused-sm90"


def cache_get(entry: Path) -> dict | None:
    if not (entry / "meta.json").is_file():
        return None
    out = {f.stem: f.read_text() for f in entry.glob("*.txt")}
    out["meta"] = json.loads((entry / "meta.json").read_text())
    return out


def cache_put(entry: Path, artifacts: dict) -> None:
    """Written whole into a temporary folder, then renamed into place: a reader sees all of an entry or none."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}-", dir=entry.parent))
    for name, value in artifacts.items():
        if name != "meta":
            (tmp / f"{name}.txt").write_text(value)
    (tmp / "meta.json").write_text(json.dumps(artifacts["meta"]))
    try:
        os.rename(tmp, entry)
    except OSError:  # another run put it there first
        shutil.rmtree(tmp, ignore_errors=True)


def workers(requested: int | None) -> int:
    if requested:
        return requested
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def compile_all(specs: list[dict], nvcc: str | None, cache: Path | None, jobs: int) -> tuple[list[dict], dict]:
    """Every Triton specialization and nvcc job compiled once, ``jobs`` at a time in worker
    processes (spawned: no forked torch state). The longest jobs go first (the split8, split16 and
    blockwise update variants), then nvcc's, then the rest. Prints each specialization's time as it ends."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    def weight(i):  # measured (docs/results/sm90-kernels.md): split8 and the every-encoding launch take longest, then int4
        c = specs[i]["config"] if specs[i]["name"] == "_adamw_update_kernel" else ""
        return 4 * ("SPLIT8" in c) + 2 * ("SPLIT16" in c) + ("CODE_BITS" in c) + ("CODE_BITS=4" in c) + ("WRITE_GRAD=True" in c) / 2

    order = sorted(range(len(specs)), key=weight, reverse=True)
    heavy = [i for i in order if weight(i) >= 3]
    jobs_in_order = [("triton", i) for i in heavy] + [("nvcc", job) for job in (("passes", "probes") if nvcc else ())] \
        + [("triton", i) for i in order if i not in heavy]
    artifacts, cuda = [None] * len(specs), {}
    with tempfile.TemporaryDirectory(prefix="sm90-triton-") as triton_cache, \
            ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_set_env,
                                initargs=("TRITON_CACHE_DIR", triton_cache)) as pool:  # no stale Triton cache: a miss compiles
        futures = {(pool.submit(compile_one, specs[what], cache) if kind == "triton" else
                    pool.submit(nvcc_job, what, nvcc, cache)): what for kind, what in jobs_in_order}
        for future in as_completed(futures):
            what, art = futures[future], future.result()
            if isinstance(what, str):
                cuda[what] = art
                label = "passes.cu (nvcc)" if what == "passes" else "sm90_probes.cu (nvcc, twice)"
                took = "cached" if art["cached"] else f"{art['compile_s']:.1f} s"
            else:
                artifacts[what] = art
                label = f"{specs[what]['name']} [{specs[what]['config']}]"
                took = "cached" if art["cached"] else (f"{art['compile_s']:.1f} s ({art['compile_cpu_s']:.1f} s CPU) "
                                                       f"+ cuobjdump {art['tools_s']:.1f} s")
            print(f"  compiled {label}: {took}", flush=True)
    return artifacts, cuda


def time_summary(specs: list[dict], artifacts: list[dict], cuda: dict, jobs: int, wall: float) -> str:
    fresh = [a for a in artifacts if not a["cached"]]
    line = (f"compile: {len(specs)} Triton specializations ({len(fresh)} compiled, {len(specs) - len(fresh)} from the cache)"
            f" and {len(cuda)} nvcc jobs ({sum(not a['cached'] for a in cuda.values())} compiled), {jobs} workers: "
            f"{wall:.0f} s wall")
    if fresh:
        each = sorted(a["compile_s"] for a in fresh)
        cpu = sorted(a["compile_cpu_s"] for a in fresh)
        line += (f"; Triton's compile (ptxas included) per specialization: median {each[len(each) // 2]:.1f} s wall / "
                 f"{cpu[len(cpu) // 2]:.1f} s CPU, max {each[-1]:.1f} / {cpu[-1]:.1f} s, sum {sum(each):.0f} / {sum(cpu):.0f} s; "
                 f"cuobjdump {sum(a['tools_s'] for a in fresh):.0f} s in all")
        for name in sorted({s["name"] for s in specs}):
            mine = [a for s, a in zip(specs, artifacts) if s["name"] == name and not a["cached"]]
            if mine:
                line += (f"\n  {name}: {len(mine)} compiled, {sum(a['compile_s'] for a in mine) / len(mine):.1f} s wall / "
                         f"{sum(a['compile_cpu_s'] for a in mine) / len(mine):.1f} s CPU each (max "
                         f"{max(a['compile_s'] for a in mine):.1f} / {max(a['compile_cpu_s'] for a in mine):.1f} s)")
    for job, art in sorted(cuda.items()):
        if not art["cached"]:
            line += f"\n  nvcc {job}: {art['compile_s']:.1f} s"
    return line


def budget_problems(name, regs, smem, config):
    max_regs, max_smem = BUDGET[name]
    if name == "update_kernel" and "compact" in config:
        max_regs = 128  # a lane's whole group ([note: compact registers] in csrc/cuda/compact_update.cuh)
    out = []
    if regs > max_regs:
        out.append(f"{name} [{config}]: {regs} registers > budget {max_regs}")
    if smem > max_smem:
        out.append(f"{name} [{config}]: {smem} B shared memory > budget {max_smem}")
    return out


def tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends/nvidia/bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} (Triton's NVIDIA backend tools)")
    return str(path)


@functools.lru_cache(maxsize=None)
def tool_versions() -> str:
    """ptxas and cuobjdump by their releases (not their paths: a new virtual environment is no new compiler)."""
    return "\n".join(run_tool([tool(name), "--version"]) for name in ("ptxas", "cuobjdump"))


def run_tool(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def report_table(rows: list[dict]) -> str:
    """One row per compiled kernel; ``compile (s)``: Triton's compile of the specialization (ptxas
    included), wall and CPU seconds, measured when it was compiled (a cached row keeps the times of
    the run that made it)."""
    lines = ["| kernel | config | threads | regs | spill st/ld (B) | stack (B) | smem (B) | spills in hot loops | blocks/SM "
             "| occupancy | compile wall / CPU (s) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        blocks, occ = r["occupancy"]
        took = f"{r['compile_s'][0]:.1f} / {r['compile_s'][1]:.1f}" if "compile_s" in r else "-"
        lines.append(f"| {r['kernel']} | {r['config']} | {r['threads']} | {r['regs']} | {r['spill_stores']}/{r['spill_loads']} "
                     f"| {r['stack']} | {r['smem_total']} | {r['inner_spills']} | {blocks} | {occ:.0%} | {took} |")
    return "\n".join(lines)


def vector_table(rows: list[dict]) -> str:
    """Global accesses by width in the update variants' aligned full-block loops ([note: vector rule])."""
    rows = [r for r in rows if "vectors" in r]
    if not rows:
        return ""
    widths = [f"{op}.{bits}" for op in ("LDG", "STG") for bits in (128, 64, 32, 16, 8)]
    lines = ["Global accesses in the update's aligned block loops (innermost loops that move 128 bits somewhere; "
             "[note: vector rule] in the script), by instruction and bits a thread moves:", "",
             "| config | loops | " + " | ".join(widths) + " |", "|---|---:|" + "---:|" * len(widths)]
    for r in rows:
        config = r["config"].replace("BLOCK=512, CHUNK=8192, TABLE_BLOCK=1024, EMULATE_FMA=False, ", "")
        lines.append(f"| {config} | {r['vectors']['loops']} | " + " | ".join(str(r["vectors"][w]) for w in widths) + " |")
    return "\n".join(lines)


def cuda_tables(rows: list[dict], probes: dict[str, tuple[int, int]]) -> str:
    """The CUDA kernels' memory instructions, the update variants' bytes in flight, the contraction probes."""
    cuda = [r for r in rows if "memory" in r]
    if not cuda:
        return ""
    needed = HBM["bytes_per_s"] / HBM["sms"] * HBM["latency_s"]
    lines = ["| kernel | config | LDG | STG | generic LD | generic ST | LDS | LDS in innermost loops |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in cuda:
        m = r["memory"]
        lines.append(f"| {r['kernel']} | {r['config']} | {m['LDG']} | {m['STG']} | {m['LD']} | {m['ST']} | {m['LDS']} "
                     f"| {r['loop_lds']} |")
    lines += ["", f"Bytes in flight per SM ([note: bytes in flight] in the script): Little's law with H200 HBM3e at "
              f"{HBM['bytes_per_s'] / 1e12:.1f} TB/s over {HBM['sms']} SMs and {HBM['latency_s'] * 1e9:.0f} ns loaded "
              f"latency (an assumption) needs {needed / 1024:.1f} KiB in flight per SM.", "",
              "| update variant | representative tensor | regs | blocks/SM | B/thread in flight | KiB in flight per SM "
              "| est. share of HBM bandwidth |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in cuda:
        if "flight" in r:
            what, per_thread = FLIGHT[r["config"]]
            lines.append(f"| {r['config']} | {what} | {r['regs']} | {r['occupancy'][0]} | {per_thread} "
                         f"| {r['flight'][0] / 1024:.1f} | {r['flight'][1]:.0%} |")
    if probes:
        lines += ["", "Contraction probes (tests/contract/sm90_probes.cu): FFMA+DFMA in each scalar routine compiled "
                  "alone, with nvcc's default contraction and with `--fmad=false` (equal: nothing contracted).", "",
                  "| probe | default | --fmad=false |", "|---|---:|---:|"]
        lines += [f"| {name} | {a} | {b} |" for name, (a, b) in sorted(probes.items())]
    return "\n".join(lines)


def nvcc_release() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        return "no nvcc"
    m = re.search(r"release ([0-9.]+)", run_tool([nvcc, "--version"]))
    return f"nvcc {m.group(1)}" if m else "nvcc"


def source_tree() -> str:
    import ampfused

    where = Path(ampfused.__file__).resolve().parent
    if where != ROOT / "ampfused":
        raise RuntimeError(f"imported ampfused from {where}, not from this checkout ({ROOT}): two source trees")
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "ampfused", "kernels", "csrc", "tests/contract"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return f"commit {commit}" + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def main() -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the table as markdown here")
    parser.add_argument("--no-cuda", action="store_true", help="skip passes.cu even when nvcc is found")
    parser.add_argument("--keep", type=Path, help="write each Triton kernel's PTX and SASS into this folder")
    parser.add_argument("--jobs", type=int, help="worker processes (default: the cores this process may use)")
    parser.add_argument("--cache", type=Path, default=default_cache(),
                        help="compiled artifacts by source hash ([note: compile cache]; default: %(default)s)")
    parser.add_argument("--no-cache", action="store_true", help="compile everything, read and write no cache")
    args = parser.parse_args()
    global KEEP
    KEEP = args.keep
    if KEEP is not None:
        KEEP.mkdir(parents=True, exist_ok=True)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the offline compile needs the GPU code path", file=sys.stderr)
        return 2
    try:
        tool("ptxas"), tool("cuobjdump")
    except (ImportError, FileNotFoundError) as exc:
        print(f"the sm90 check needs Triton with its NVIDIA backend tools: {exc}", file=sys.stderr)
        return 2
    cache = None if args.no_cache else args.cache
    install_fake_driver()
    try:
        tree = source_tree()
    except RuntimeError as exc:
        print("FAIL:", exc)
        return 1
    print(f"source tree: {ROOT} ({tree}): kernels for Triton, csrc/ for nvcc", flush=True)
    specs = enumerate_triton()
    nvcc = None if args.no_cuda else find_nvcc()
    jobs = workers(args.jobs)
    compile_start = time.perf_counter()
    artifacts, cuda = compile_all(specs, nvcc, cache, jobs)
    summary = time_summary(specs, artifacts, cuda, jobs, time.perf_counter() - compile_start)
    rows, problems = analyze_triton(specs, artifacts)
    probes = {}
    if nvcc is not None:
        cuda_rows, cuda_problems = analyze_cuda(cuda["passes"])
        probes, probe_problems = analyze_probes(cuda["probes"])
        rows, problems = rows + cuda_rows, problems + cuda_problems + probe_problems
    text = report_table(rows)
    if vectors := vector_table(rows):
        text += "\n\n" + vectors
    if parity := parity_table(rows):
        text += "\n\n" + parity
    extra = cuda_tables(rows, probes)
    if extra:
        text += "\n\n" + extra
    problems += completeness(rows, parity, extra, probes, nvcc)
    print(text)
    print(summary)
    for p in problems:
        print("FAIL:", p)
    if args.out:
        import triton

        args.out.write_text(
            "# sm_90 offline compile of every kernel\n\n"
            f"`python tests/contract/sm90_compile.py --out {args.out}` (Triton {triton.__version__}, its ptxas; "
            f"{nvcc_release()} for passes.cu), no GPU: the configurations the code launches, compiled for `GPUTarget(\"cuda\", 90, 32)`. "
            f"One source tree for both compilers: the checkout ({tree}), its kernels for Triton and its csrc/ for nvcc. "
            "Occupancy is computed from registers, threads and shared memory for an H100/H200 SM "
            "(65536 registers, 64 warps, 32 blocks, 228 KB). Budgets and rules: the docstring of the script.\n\n"
            + text + "\n\nCompile times (this run, " + machine() + "):\n\n```\n" + summary + "\n```\n\n"
            + ("All rules pass.\n" if not problems else "\n".join(f"- FAIL: {p}" for p in problems) + "\n"))
    print(f"sm90 check: {'FAILED, ' + str(len(problems)) + ' problems' if problems else 'every rule passes'} "
          f"({time.perf_counter() - started:.0f} s)")
    return 1 if problems else 0


def machine() -> str:
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() else platform.machine()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    return f"{os.cpu_count()} cores of {cpu}, load average at the end {load}"


def completeness(rows: list[dict], parity: str, cuda: str, probes: dict, nvcc: str | None) -> list[str]:
    """What the check must have seen to mean anything (the run fails without it): the stats and update
    kernels, the int4 variants beside their int8 twins, and with nvcc the CUDA kernels and probes."""
    problems = []
    kernels = {r["kernel"] for r in rows}
    for name in ("_grad_stats_kernel", "_adamw_update_kernel", "_scaler_update_kernel", "_accumulate_kernel"):
        if name not in kernels:
            problems.append(f"{name}: not compiled (the launches did not reach it)")
    if not parity:
        problems.append("no int4-moment update variant compiled beside its int8 twin (int4 moments against int8)")
    if nvcc is not None:
        if "est. share of HBM bandwidth" not in cuda:
            problems.append("passes.cu: no CUDA update variant in the bytes-in-flight table")
        if "probe_scalars_decay" not in probes:
            problems.append("sm90_probes.cu: the contraction probes were not compiled")
    return problems


if __name__ == "__main__":
    sys.exit(main())
