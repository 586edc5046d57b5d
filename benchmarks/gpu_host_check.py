"""Host time and launches per step, for benchmarks/gpu_check.sh (runs on CPU too, for CI).

For 148, 291 and 2000 tiny tensors (device time ~0, so the step is host-bound) it times one
``step()`` + ``scaler.update()`` of stock ``AdamW(fused=True)`` (with and without
``clip_grad_norm_``) and of ``FusedAmpAdamW`` on every backend; it counts the kernels one
ampfused step launches (torch profiler) and times the host side of a step right after every
gradient moved to a new address (the table cache's worst case). Writes a CSV, prints a table.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch

import ampfused
from ampfused import _backends


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_ms(step, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()  # host time: until the call returns, nothing synchronized inside
        times.append((time.perf_counter() - start) * 1e3)
        sync(device)
    return statistics.median(times)


def launches(step, device):
    """Device activities of ``step`` (the optimizer and scaler calls only, not the loss scaling):
    kernels and memsets, and separately the copies (a steady-state step should have none)."""
    if device.type != "cuda":
        return "", ""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for n in names if n.startswith("Memcpy"))
    return len(names) - copies, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensors", default="148,291,2000")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="host.csv")
    args = parser.parse_args()
    device = torch.device(args.device)
    backends = [n for n in _backends.BACKEND_NAMES if _ok(n, device)]
    rows = []
    for n in (int(x) for x in args.tensors.split(",")):
        for clip in (None, 1.0):
            params = [torch.nn.Parameter(torch.randn(64, device=device)) for _ in range(n)]
            for p in params:
                p.grad = torch.randn_like(p)
            stock = torch.optim.AdamW(params, fused=True)
            scaler = torch.amp.GradScaler(device.type)

            loss = torch.ones((), device=device)

            def stock_opt():
                scaler.unscale_(stock)
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                scaler.step(stock)
                scaler.update()

            def stock_step():
                scaler.scale(loss)
                stock_opt()

            stock_step()
            kernels, copies = launches(stock_opt, device)
            rows.append(dict(tensors=n, clip=clip, impl="torch-fused", host_ms=host_ms(stock_step, device, args.repeats),
                             launches=kernels, copies=copies))
            save(rows, args.out)
            for name in backends:
                opt = ampfused.FusedAmpAdamW(params, backend=name, max_grad_norm=clip)
                ours = ampfused.GradScaler(device.type)

                def our_opt():
                    ours.step(opt)
                    ours.update()

                def our_step():
                    ours.scale(loss)
                    our_opt()

                our_step()
                kernels, copies = launches(our_opt, device)
                row = dict(tensors=n, clip=clip, impl=f"ampfused-{name}", host_ms=host_ms(our_step, device, args.repeats),
                           launches=kernels, copies=copies)

                def moved_step():  # every grad at a new address, as zero_grad(set_to_none=True) can give
                    for p in params:
                        p.grad = p.grad.clone()
                    sync(device)
                    start = time.perf_counter()
                    our_step()
                    return (time.perf_counter() - start) * 1e3

                row["host_ms_after_pointer_change"] = statistics.median(moved_step() for _ in range(5))
                rows.append(row)
                save(rows, args.out)


KEYS = ["tensors", "clip", "impl", "host_ms", "host_ms_after_pointer_change", "launches", "copies"]


def save(rows, path):
    """The whole CSV again after every row: a run cut short by its timeout keeps what it measured."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, KEYS)
        writer.writeheader()
        writer.writerows(rows)
    row = rows[-1]
    print("  ".join(f"{k}={row.get(k, '')}" if not isinstance(row.get(k), float) else f"{k}={row[k]:.3f}" for k in KEYS),
          flush=True)


def _ok(name, device):
    if name == "triton" and device.type == "cpu":
        return False  # the interpreter measures nothing useful
    try:
        _backends.resolve(name, device)
        return True
    except RuntimeError:
        return False


if __name__ == "__main__":
    main()
