"""How much code a reader follows for one optimizer step, per backend (docs/design.md §5).

Run from a checkout: ``TRITON_INTERPRET=1 python benchmarks/step_path.py``. One warm
``FusedAmpAdamW.step()`` with a ``GradScaler`` and clipping (bf16 params with fp32 masters, as the
common mixed-precision step) is traced with ``sys.settrace``; every repository file whose lines run
is listed with the lines it ran, the lines of the functions the step enters there (what a reader of
the step follows: each function whole, its docstring and comments included) and the file's length. The Triton kernels run in the interpreter, so their
Python is traced too. The compiled path's Python is traced on the ``cpu`` backend (the same
``_compiled.py`` as ``cuda``); the C++/CUDA sources a CUDA step runs are listed from the build's
include graph, since a trace cannot see them: the op registration and wrapper and the CUDA sources,
with what they include, transitively.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CUDA_ENTRY = ("csrc/ops.cpp", "csrc/ops_common.cpp", "csrc/cuda/ops_cuda.cpp", "csrc/cuda/passes.cu")


def trace_step(backend: str, optimizer_only: bool = False) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """({file: lines run}, {file: lines of the functions entered}) of one warm step."""
    import torch

    import ampfused

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler("cpu")

    def one_step():
        loss = model(torch.randn(16, 64, dtype=torch.bfloat16)).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    one_step()  # state, plan and tables built; the traced step is a warm one
    loss = model(torch.randn(16, 64, dtype=torch.bfloat16)).float().square().mean()
    scaler.scale(loss).backward()
    ran: dict[str, set[int]] = {}
    entered = set()
    root = str(ROOT) + os.sep

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root) or "/tests/" in path or path.endswith("step_path.py"):
            return None
        if event == "call":
            entered.add(frame.f_code)
        ran.setdefault(os.path.relpath(path, ROOT), set()).add(frame.f_lineno)
        return tracer

    if optimizer_only:  # opt.step() as scaler.step calls it: the loss scale handed over (torch's protocol)
        opt.grad_scale = scaler.get_scale() * torch.ones((), device="cpu")
    sys.settrace(tracer)
    try:
        if optimizer_only:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    finally:
        sys.settrace(None)
    return ran, function_lines(entered)


def function_lines(codes) -> dict[str, set[int]]:
    """The source lines of every function in ``codes``, per file (a nested function counted once)."""
    lines: dict[str, set[int]] = {}
    for code in codes:
        source, first = inspect.getsourcelines(code)
        lines.setdefault(os.path.relpath(code.co_filename, ROOT), set()).update(range(first, first + len(source)))
    return lines


def included(sources) -> list[str]:
    """The repository files the given C++/CUDA sources include, transitively (quoted includes)."""
    seen, todo = [], [ROOT / s for s in sources]
    while todo:
        path = todo.pop()
        rel = path.relative_to(ROOT).as_posix()
        if rel in seen or not path.exists():
            continue
        seen.append(rel)
        for name in re.findall(r'#include\s+"([^"]+)"', path.read_text()):
            todo.append((path.parent / name).resolve())
    return sorted(seen)


def length(rel: str) -> int:
    return len((ROOT / rel).read_text().splitlines())


def report(title: str, traced, extra: list[str] = ()) -> None:
    ran, functions = traced
    print(f"\n{title}")
    print(f"  {'file':40s} {'lines run':>9s} {'in functions entered':>21s} {'in the file':>11s}")
    total_ran = total_functions = total_len = 0
    for rel in sorted(ran):
        n_ran, n_functions, n_len = len(ran[rel]), len(functions.get(rel, ())), length(rel)
        total_ran, total_functions, total_len = total_ran + n_ran, total_functions + n_functions, total_len + n_len
        print(f"  {rel:40s} {n_ran:9d} {n_functions:21d} {n_len:11d}")
    for rel in extra:
        total_len += length(rel)
        print(f"  {rel:40s} {'(C++/CUDA)':>31s} {length(rel):11d}")
    files = len(ran) + len(extra)
    print(f"  {files} files, {total_len} lines in them; {total_functions} Python lines in the functions entered, "
          f"{total_ran} of them run")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer-only", action="store_true",
                        help="trace opt.step() alone (no GradScaler step or update), the path the optimizer's reader follows")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("set TRITON_INTERPRET=1: the Triton step is traced through the interpreter", file=sys.stderr)
        return 2
    report("triton step", trace_step("triton", args.optimizer_only))
    report("compiled step (Python on the cpu backend; the CUDA sources it launches)", trace_step("cpu", args.optimizer_only),
           included(CUDA_ENTRY))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
