"""Compile every GPU kernel for sm_90 offline and check what only a GPU would show.

    python tests/contract/sm90_compile.py [--out docs/results/sm90-kernels.md]      (exit 1 on a failed rule)

No GPU is needed. Triton: a fake active driver reports ``GPUTarget("cuda", 90, 32)`` and every
kernel launch of the real wrappers (``ampfused.kernels``, called on CPU tensors with the GPU block
sizes) is turned into ``warmup``: the configurations compiled are exactly those the code launches
(constexprs, specialization of ints and pointer alignment, num_warps, maxnreg, fp fusion), with
``EMULATE_FMA=False`` as on a GPU. ptxas (Triton's own, from its wheel) compiles the PTX with
``-v``; the SASS comes from Triton's cuobjdump. CUDA: ``csrc/cuda/passes.cu`` (ATen-free) with
``nvcc -arch=sm_90 -Xptxas -v`` when nvcc is found.

Rules (each failure is printed; see [note: rules]):
  flags    no self-subtraction ``sub.f32 x, a, a`` in any PTX; the stats kernel tests the exponent
           bits (``and.b32 .., 2139095040``) of a value no fma produced; kernels compiled without fp
           fusion (update, scaler) have only ``.rn`` fp32/fp64 mul/add/sub, which ptxas never
           contracts; the scaler's PTX has no fma at all.
  spills   no local-memory load/store (LDL/STL) inside an innermost loop of the SASS (a backward
           branch with no other loop inside): loop-invariant scalars may spill, the streaming
           loops may not.
  budget   registers and shared memory per kernel at most BUDGET below.
  pow      no ``__internal_accurate_pow`` in the CUDA update kernel.

Must run with TRITON_INTERPRET unset (tests/contract/test_sm90_compile.py runs it in a subprocess).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# [note: budgets] registers per thread / static shared memory per block (bytes). The update kernel
# runs under maxnreg=72 (80 for its split8 and int8-moment variants); the stats kernel holds 2-4 loads in flight a thread (see _runtime.py).
BUDGET = {"_grad_stats_kernel": (96, 16384), "_adamw_update_kernel": (72, 16384), "_scaler_update_kernel": (64, 1024),
          "_accumulate_kernel": (64, 16384), "stats_kernel": (64, 4096), "update_kernel": (64, 4096),
          "scaler_update_kernel": (64, 1024), "accumulate_kernel": (64, 1024)}
REGISTER_UNIT = 256  # sm_90 allocates a warp's registers in units of 256
SM90 = dict(regs=65536, threads=2048, blocks=32, smem=233472, smem_reserved=1024)


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


def compile_triton(work: Path) -> tuple[list[dict], list[str]]:
    import torch
    from triton.runtime.jit import JITFunction

    compiled = []
    original_run = JITFunction.run

    def warmup_instead(self, *args, grid, warmup, **kwargs):
        if "EMULATE_FMA" in kwargs:
            kwargs["EMULATE_FMA"] = False  # what a CUDA device launches
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        fused = kwargs.get("enable_fp_fusion", True)
        compiled.append(dict(name=self.fn.__name__, kernel=kernel, fused=fused,
                             config=", ".join(f"{k}={v}" for k, v in kwargs.items() if k.isupper())))
        return kernel

    JITFunction.run = warmup_instead
    from ampfused._contract import INT8_BLOCK, Hyper
    from ampfused.kernels import _runtime, accumulate, adamw, scaler, stats

    assert not _runtime.INTERPRET, "TRITON_INTERPRET is set: these would be interpreter sizes"
    numels = [50257 * 768, 768, 3 * 768 * 768, 4097]  # big (many chunks), small, odd tail
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.ones(n, dtype=dtype) for n in numels]
        for has_scale, has_found, clip in ((False, False, None), (True, False, 1.0), (True, True, None), (False, False, 1.0)):
            stats.grad_stats_(grads, torch.ones(()) if has_scale else None, torch.zeros(()) if has_found else None,
                              clip, torch.zeros(4))
    params = [torch.zeros(n) for n in numels]
    fp32 = lambda: [torch.zeros(n) for n in numels]  # noqa: E731
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
    adamw.adamw_update_(params, fp32(), fp32(), fp32(), [None] * 4, [torch.zeros(()) for _ in numels], [None] * 4,
                        [0] * 4, [hyper], torch.zeros(4))
    compact_updates(adamw, hyper, numels)
    for min_scale in (None, 1.0):
        scaler.scaler_update_(torch.zeros(()), torch.ones(()), torch.zeros((), dtype=torch.int32),
                              torch.ones((), dtype=torch.int32), torch.zeros((), dtype=torch.int64),
                              torch.zeros((), dtype=torch.int64), torch.zeros(2, dtype=torch.float64),
                              growth_factor=1.5, backoff_factor=0.3, growth_interval=2000, hysteresis=1, min_scale=min_scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        accumulate.accumulate_(torch.zeros(1 << 20), torch.zeros(1 << 20, dtype=dtype))
    JITFunction.run = original_run

    rows, problems, seen = [], [], set()
    ptxas, cuobjdump = tool("ptxas"), tool("cuobjdump")
    for i, entry in enumerate(compiled):
        kernel = entry["kernel"]
        key = (entry["name"], kernel.hash)
        if key in seen:
            continue
        seen.add(key)
        ptx_file, cubin_file = work / f"triton{i}.ptx", work / f"triton{i}.cubin"
        ptx_file.write_text(kernel.asm["ptx"])
        cubin_file.write_bytes(kernel.asm["cubin"])
        info = ptxas_info(run([ptxas, "-arch=sm_90a", "-v", str(ptx_file), "-o", str(work / "scratch.cubin")]))
        info = next(iter(info.values()))
        sass = sass_functions(run([cuobjdump, "-sass", str(cubin_file)]))
        inner = spills_in_inner_loops(next(iter(sass.values())))
        threads = kernel.metadata.num_warps * 32
        smem = max(info["smem"], kernel.metadata.shared)
        rows.append(dict(kernel=entry["name"], config=entry["config"], threads=threads, **info, smem_total=smem,
                         inner_spills=len(inner), occupancy=occupancy(info["regs"], threads, smem)))
        problems += flag_rules(entry["name"], kernel.asm["ptx"], entry["fused"])
        problems += [f"{entry['name']} [{entry['config']}]: spill in a hot loop: {s}" for s in inner]
        problems += budget_problems(entry["name"], info["regs"], smem, entry["config"])
    return rows, problems


def compact_updates(adamw, hyper, numels):
    """The update's compact variants (DESIGN §9): split16 alone (the most common), bf16 moments with
    stochastic rounding, split8 with bf16 moments, int8 moments, and every encoding in one launch."""
    import torch
    from ampfused._contract import INT8_BLOCK

    def tensors(param_dtype, master_dtype, state_dtype, n):
        p = torch.zeros(n, dtype=param_dtype)
        master = None if master_dtype is None else torch.zeros(n, dtype=master_dtype)
        if state_dtype == "int8":
            moments = [torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)]
            blocks = -(-n // INT8_BLOCK)
            scales = (torch.zeros(blocks), torch.zeros(blocks), None)
        else:
            moments, scales = [torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)], None
        return p, torch.zeros(n), moments, master, scales

    def launch(configs, seed=None):
        rows = [tensors(*config, n) for config, n in zip(configs, numels)]
        adamw.adamw_update_([r[0] for r in rows], [r[1] for r in rows], [r[2][0] for r in rows], [r[2][1] for r in rows],
                            [None] * len(rows), [torch.zeros(()) for _ in rows], [r[3] for r in rows], [0] * len(rows),
                            [hyper], torch.zeros(4), moment_scales=[r[4] for r in rows], rounding_seed=seed)

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    launch([(bf16, torch.int16, fp32)] * 4)
    launch([(bf16, None, bf16)] * 4, seed=1)
    launch([(fp16, torch.int8, bf16)] * 4)
    launch([(bf16, torch.int16, "int8")] * 4)
    launch([(bf16, torch.int16, "int8"), (fp32, None, fp32), (bf16, None, bf16), (fp16, torch.int8, fp32)], seed=1)


# -------------------------------------------------------------------------------------------- CUDA

def compile_cuda(work: Path) -> tuple[list[dict], list[str]]:
    nvcc = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc")), None)
    if nvcc is None:
        return [], []
    obj = work / "passes.o"
    log = run([nvcc, "-arch=sm_90", "-O3", "-std=c++17", f"-I{ROOT / 'csrc'}", "-Xptxas", "-v", "-c",
               str(ROOT / "csrc/cuda/passes.cu"), "-o", str(obj)])
    sass = sass_functions(run([tool("cuobjdump"), "-sass", str(obj)]))
    ptx = run([nvcc, "-arch=sm_90", "-O3", "-std=c++17", f"-I{ROOT / 'csrc'}", "-ptx", str(ROOT / "csrc/cuda/passes.cu"),
               "-o", "-"])
    rows, problems = [], []
    for mangled, info in ptxas_info(log).items():
        name = next(n for n in ("scaler_update_kernel", "accumulate_kernel", "update_kernel", "stats_kernel") if n in mangled)
        threads = 1 if name == "scaler_update_kernel" else 512
        inner = spills_in_inner_loops(sass.get(mangled, []))
        config = {"INS_8BFloat16": "bf16", "INS_4Half": "fp16", "IfE": "fp32",  # accumulate's grad dtype
                  "ILi0E": "plain", "ILi1E": "compact", "ILi2E": "compact + int8 moments"}  # update's variant
        dtype = next((v for k, v in config.items() if k in mangled), "")
        rows.append(dict(kernel=f"{name} (CUDA)", config=dtype, threads=threads, **info, smem_total=info["smem"],
                         inner_spills=len(inner), occupancy=occupancy(info["regs"], threads, info["smem"])))
        problems += [f"{name} (CUDA): spill in a hot loop: {s}" for s in inner]
        problems += budget_problems(name, info["regs"], info["smem"], dtype)
    if "__internal_accurate_pow" in ptx:
        problems.append("passes.cu: __internal_accurate_pow is still compiled in (bias corrections per element)")
    return rows, problems


# ------------------------------------------------------------------------------------------ common

def budget_problems(name, regs, smem, config):
    max_regs, max_smem = BUDGET[name]
    if name == "_adamw_update_kernel" and ("SPLIT8=True" in config or "INT8_STATE=True" in config):
        max_regs = 80  # the compact variants' cap (kernels/_runtime.py, [note: compact registers])
    if name == "update_kernel" and "int8" in config:
        max_regs = 128  # a warp's new int8 moments wait for their block's scale (csrc/cuda/compact_update.cuh)
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


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def table(rows: list[dict]) -> str:
    lines = ["| kernel | config | threads | regs | spill st/ld (B) | stack (B) | smem (B) | spills in hot loops | blocks/SM | occupancy |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        blocks, occ = r["occupancy"]
        lines.append(f"| {r['kernel']} | {r['config']} | {r['threads']} | {r['regs']} | {r['spill_stores']}/{r['spill_loads']} "
                     f"| {r['stack']} | {r['smem_total']} | {r['inner_spills']} | {blocks} | {occ:.0%} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the table as markdown here")
    parser.add_argument("--no-cuda", action="store_true", help="skip passes.cu even when nvcc is found")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the offline compile needs the GPU code path", file=sys.stderr)
        return 2
    install_fake_driver()
    with tempfile.TemporaryDirectory() as tmp:
        rows, problems = compile_triton(Path(tmp))
        if not args.no_cuda:
            cuda_rows, cuda_problems = compile_cuda(Path(tmp))
            rows, problems = rows + cuda_rows, problems + cuda_problems
    text = table(rows)
    print(text)
    for p in problems:
        print("FAIL:", p)
    if args.out:
        import triton

        args.out.write_text(
            "# sm_90 offline compile of every kernel\n\n"
            f"`python tests/contract/sm90_compile.py --out {args.out}` (Triton {triton.__version__}, its ptxas; nvcc for "
            "passes.cu), no GPU: the configurations the code launches, compiled for `GPUTarget(\"cuda\", 90, 32)`. "
            "Occupancy is computed from registers, threads and shared memory for an H100/H200 SM "
            "(65536 registers, 64 warps, 32 blocks, 228 KB). Budgets and rules: the docstring of the script.\n\n"
            + text + "\n\n" + ("All rules pass.\n" if not problems else "\n".join(f"- FAIL: {p}" for p in problems) + "\n"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
