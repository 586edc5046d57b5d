"""The README's results tables, generated from a benchmark run, and the command that pastes them in.

``bench`` writes ``summary.md`` next to ``bench.md``; ``bench train`` writes ``summary.md`` next to
``train.md``. To refresh the README after new runs:

    python -m ampfused.bench.summary --bench bench-results --train bench-results/train --readme README.md

which replaces what lies between the ``<!-- bench-summary -->`` / ``<!-- train-summary -->``
markers and their ``<!-- end -->`` lines. [note: generated results] numbers in the README come
only from a run's output, with its date, machine and command, so they can be regenerated rather
than hand-edited.
"""
from __future__ import annotations

import argparse
import os
import re
import sys


def _main_backend(rows) -> str | None:
    """The ampfused provider the headline speedups are for: the first measured one that is not the reference."""
    names = [r["provider"] for r in rows if r["provider"].startswith("ampfused-") and "@" not in r["provider"]
             and r["status"] != "untimed"]
    names = list(dict.fromkeys(names))
    return next((n for n in names if n != "ampfused-reference"), names[0] if names else None)


def _cell(row, key="median_ms", spec=".2f") -> str:
    if row is None or row["status"] != "ok":
        return "FAILED" if row is not None and row["status"] == "FAILED" else "–"
    return format(row[key], spec) + (" †" if row["unstable"] else "")


def bench_summary(rows: list[dict], env: dict) -> str:
    main = _main_backend(rows)
    ampfused = list(dict.fromkeys(r["provider"] for r in rows if r["provider"].startswith("ampfused-") and "@" not in r["provider"]
                                  and r["status"] != "untimed"))  # (an oracle gated but not timed has no column)
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["provider"]] = r
    timed = [r for r in rows if r["status"] == "ok"]
    unstable = sum(1 for r in timed if r["unstable"])
    untimed = list(dict.fromkeys(r["provider"] for r in rows if r["status"] == "untimed"))
    lines = [
        f"Measured {env['date']} on {env['hardware']}; torch {env['torch']}, triton {env['triton']}, "
        f"ampfused {env['ampfused']}; `{env.get('command', 'python -m ampfused bench')}` "
        f"({env.get('wall_s', '?')} s wall; other processes kept {env.get('other_cores', '?')} cores busy on average). "
        f"{unstable} of {len(timed)} timings unstable (marked †). ms per step, median." +
        (f" Gated on every case but not timed (the oracle): {', '.join(untimed)}." if untimed else ""),
        "",
    ]
    device_cases = [c for c, p in by_case.items() if next(iter(p.values()))["timer"] != "host"]
    if device_cases and main:
        head = ["case", "torch-fused", "torch-foreach", *ampfused, f"{main} × fused", f"{main} × foreach",
                "B/param stock / ampfused"]
        lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 2) + "|---|"]
        for case in device_cases:
            p = by_case[case]
            m, fused = p.get(main), p.get("torch-fused")
            speed = _cell(m, "speedup_vs_torch_fused") if m and m["speedup_vs_torch_fused"] != "" else "–"
            if m and m["status"] == "ok" and m["speedup_vs_torch_fused"] != "" and m["speedup_vs_torch_fused"] < 1:
                speed = f"**{speed} (slower)**"
            cells = [case, _cell(fused), _cell(p.get("torch-foreach")), *(_cell(p.get(a)) for a in ampfused), speed,
                     _cell(m, "speedup_vs_torch_foreach") if m and m["speedup_vs_torch_foreach"] != "" else "–",
                     f"{fused['bytes_per_param']:g} / {m['bytes_per_param']:g}" if fused and m else "–"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    host_cases = [c for c in by_case if c not in device_cases]
    if host_cases:
        lines += ["Host time per step (`opt.step()` + `scaler.update()` on tiny tensors, device time ≈ 0), ms, median:", ""]
        head = ["tensors", "clip", "torch-fused", *ampfused, *(f"{a} ÷ torch-fused" for a in ampfused)]
        lines += ["| " + " | ".join(head) + " |", "|---:|---" + "|---:" * (len(head) - 2) + "|"]
        for case in host_cases:
            p = by_case[case]
            any_row = next(iter(p.values()))
            cells = [str(any_row["tensors"]), "yes" if any_row["clip"] else "no", _cell(p.get("torch-fused"), spec=".3f"),
                     *(_cell(p.get(a), spec=".3f") for a in ampfused),
                     *(_cell(p.get(a), "host_ratio_vs_torch_fused") if p.get(a) and p[a]["host_ratio_vs_torch_fused"] != ""
                       else "–" for a in ampfused)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += memory_table(rows, main)
    return "\n".join(lines).rstrip()


def memory_table(rows: list[dict], main: str | None) -> list[str]:
    """The memory sweep: ms per step and kept bytes per param (measured) of each mode, against stock
    fused and ampfused with fp32 masters and moments, per case."""
    memory = [r for r in rows if "memory" in r["sweeps"].split("+")]
    if not memory or main is None:
        return []
    lines = ["", f"Memory modes (DESIGN §9) on bf16 params, {main}: ms per step, median / bytes kept per param "
                 "between steps (params, master, moments, fp32 gradients; measured from the tensors):", "",
             "| case | provider | ms/step | × fp32 masters | kept B/param |", "|---|---|---:|---:|---:|"]
    by_case: dict[str, dict[str, dict]] = {}
    for r in memory:
        by_case.setdefault(r["case"], {})[r["provider"]] = r
    for case, p in by_case.items():
        fp32 = p.get(main)
        for name, r in p.items():
            if name != "torch-fused" and name != main and not name.startswith(main + "@"):
                continue
            ratio = (f"{fp32['median_ms'] / r['median_ms']:.2f}" if fp32 and fp32["status"] == "ok" and r["status"] == "ok"
                     else "–")
            kept = f"{r['kept_bytes_per_param']:.2f}" if r.get("kept_bytes_per_param") not in ("", None) else "–"
            lines.append(f"| {case} | {name} | {_cell(r)} | {ratio} | {kept} |")
    return lines


def train_summary(table: str, env: dict) -> str:
    return (f"Measured {env['date']} on {env['hardware']}; torch {env['torch']}; "
            f"`{env.get('command', 'python -m ampfused bench train')}` ({env.get('wall_s', '?')} s wall; other processes "
            f"kept {env.get('other_cores', '?')} cores busy on average); "
            f"model {env.get('model', '?')}, {env.get('steps', '?')} steps of {env.get('batch', '?')}, "
            f"{env.get('amp_dtype', '?')} autocast.\n\n{table}")


def replace_block(text: str, marker: str, content: str) -> str:
    pattern = re.compile(rf"(<!-- {marker} -->\n).*?(\n<!-- end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {marker} --> ... <!-- end --> block")
    return pattern.sub(lambda m: m.group(1) + content.strip() + m.group(2), text, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ampfused.bench.summary",
                                     description="paste the summary.md of benchmark runs into the README")
    parser.add_argument("--bench", help="output folder of `python -m ampfused bench`")
    parser.add_argument("--train", help="output folder of `python -m ampfused bench train`")
    parser.add_argument("--readme", default="README.md")
    args = parser.parse_args(argv)
    if not (args.bench or args.train):
        parser.error("give --bench and/or --train")
    for folder in (args.bench, args.train):
        if folder and not os.path.isfile(os.path.join(folder, "summary.md")):
            parser.error(f"{folder}: no summary.md (run the benchmark with --out {folder} first)")
    try:
        with open(args.readme) as f:
            text = f.read()
    except OSError as exc:
        parser.error(f"--readme: {exc.strerror}: {args.readme}")
    try:
        for marker, folder in (("bench-summary", args.bench), ("train-summary", args.train)):
            if folder:
                with open(os.path.join(folder, "summary.md")) as f:
                    text = replace_block(text, marker, f.read())
    except ValueError as exc:
        parser.error(f"{args.readme}: {exc}")
    with open(args.readme, "w") as f:
        f.write(text)
    print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
