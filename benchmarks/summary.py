"""The results summary's tables (docs/results/summary.md), generated from benchmark runs, and the command
that pastes them in.

``python -m ampfused bench`` writes ``bench.csv`` and ``run.json`` (its command, load and wall
time) to its ``--out``; ``python benchmarks/bench_train.py`` writes ``summary.md`` next to
``train.md``. To refresh docs/results/summary.md after new runs, from a checkout:

    python benchmarks/summary.py --bench bench-results --train bench-results/train

which replaces what lies between the ``<!-- bench-summary -->`` / ``<!-- train-summary -->``
markers and their ``<!-- end -->`` lines of ``--readme`` (default docs/results/summary.md, which
README.md links to; it also writes the bench table to ``<bench>/summary.md``). Those numbers come
only from a run's output, with its date, machine, command and load, so they can be regenerated
rather than hand-edited.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys

TEXT_COLUMNS = {"date", "device", "hardware", "torch", "triton", "ampfused", "python", "plan", "sweeps", "case",
                "config", "param_dtype", "family", "provider", "status", "detail", "timer", "unstable", "loadavg",
                "roofline_from"}


def read_bench(folder: str) -> tuple[list[dict], dict]:
    """The rows of a bench run's ``bench.csv`` (numbers as numbers, "" kept) and its ``run.json``."""
    def value(key, text):
        if key in TEXT_COLUMNS or text == "":
            return text
        if text in ("True", "False"):
            return text == "True"
        return float(text)

    with open(os.path.join(folder, "bench.csv"), newline="") as f:
        rows = [{k: value(k, v) for k, v in r.items()} for r in csv.DictReader(f)]
    with open(os.path.join(folder, "run.json")) as f:
        return rows, json.load(f)


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


def command(env: dict, default: str) -> str:
    """The run's command without its ``--out`` folder (a path of the machine it ran on)."""
    words, out = env.get("command", default).split(), []
    for i, word in enumerate(words):
        if not (word.startswith("--out=") or word == "--out" or (i and words[i - 1] == "--out")):
            out.append(word)
    return " ".join(out)


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
        f"ampfused {env['ampfused']}; `{command(env, 'python -m ampfused bench')}` "
        f"({env.get('wall_s', '?')} s wall; other processes kept {env.get('other_cores', '?')} cores busy on average). "
        + (f"**{env['untrusted']}.** " if env.get("untrusted") else "") +
        f"{unstable} of {len(timed)} timings unstable (marked †). ms per step, median." +
        (f" Gated but not timed (the oracle): {', '.join(untimed)}." if untimed else ""),
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
        lines += ["Host time per step (`opt.step()` + `scaler.update()` on tiny tensors, device time ≈ 0), ms, median; "
                  "grads: *same* = autograd accumulates into the same `p.grad` every step, *fresh* = new `p.grad` "
                  "tensors every step (`zero_grad(set_to_none=True)`); a ratio below 1 is ampfused faster:", ""]
        head = ["tensors", "clip", "grads", "torch-fused", *ampfused, *(f"{a} ÷ torch-fused" for a in ampfused)]
        lines += ["| " + " | ".join(head) + " |", "|---:|---|---" + "|---:" * (len(head) - 3) + "|"]
        for case in host_cases:
            p = by_case[case]
            any_row = next(iter(p.values()))
            grads = "fresh" if any_row["config"].endswith("fresh-grads") else "same"
            cells = [str(int(any_row["tensors"])), "yes" if any_row["clip"] else "no", grads,
                     _cell(p.get("torch-fused"), spec=".3f"),
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
    lines = ["", f"Memory modes ([DESIGN §9](../design.md#9-compact-state-memory-modes)) on bf16 params, {main}: "
                 "ms per step, median / bytes kept per param between steps (params, master, moments, fp32 gradients; "
                 "measured from the tensors of the model in the case column: its small and 1-d tensors keep fp32 "
                 "moments and a block cut short costs a whole scale, so the int8 rows keep a little more than the "
                 "two 1024×1024 layers of README's Memory modes table):", "",
             "| case | provider | ms/step | speed × fp32 masters (their ms ÷ this row's; above 1 is faster) | kept B/param |",
             "|---|---|---:|---:|---:|"]
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
            f"`{command(env, 'python benchmarks/bench_train.py')}` ({env.get('wall_s', '?')} s wall; other processes "
            f"kept {env.get('other_cores', '?')} cores busy on average); "
            f"model {env.get('model', '?')}, {env.get('steps', '?')} steps of {env.get('batch', '?')}, "
            f"{env.get('amp_dtype', '?')} autocast.\n\n{table}")


def replace_block(text: str, marker: str, content: str) -> str:
    pattern = re.compile(rf"(<!-- {marker} -->\n).*?(\n<!-- end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {marker} --> ... <!-- end --> block")
    return pattern.sub(lambda m: m.group(1) + content.strip() + m.group(2), text, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/summary.py",
                                     description="paste the tables of benchmark runs into the results summary")
    parser.add_argument("--bench", help="output folder of `python -m ampfused bench`")
    parser.add_argument("--train", help="output folder of `python benchmarks/bench_train.py`")
    parser.add_argument("--readme", default="docs/results/summary.md",
                        help="the markdown file whose marked blocks are replaced (default: %(default)s)")
    args = parser.parse_args(argv)
    if not (args.bench or args.train):
        parser.error("give --bench and/or --train")
    if args.bench and not all(os.path.isfile(os.path.join(args.bench, n)) for n in ("bench.csv", "run.json")):
        parser.error(f"{args.bench}: no bench.csv and run.json (run `python -m ampfused bench --out {args.bench}` first)")
    if args.train and not os.path.isfile(os.path.join(args.train, "summary.md")):
        parser.error(f"{args.train}: no summary.md (run `python benchmarks/bench_train.py --out {args.train}` first)")
    try:
        with open(args.readme) as f:
            text = f.read()
    except OSError as exc:
        parser.error(f"--readme: {exc.strerror}: {args.readme}")
    tables = {}
    if args.bench:
        tables["bench-summary"] = bench_summary(*read_bench(args.bench))
        with open(os.path.join(args.bench, "summary.md"), "w") as f:
            f.write(tables["bench-summary"] + "\n")
    if args.train:
        with open(os.path.join(args.train, "summary.md")) as f:
            tables["train-summary"] = f.read()
    try:
        for marker, table in tables.items():
            text = replace_block(text, marker, table)
    except ValueError as exc:
        parser.error(f"{args.readme}: {exc}")
    with open(args.readme, "w") as f:
        f.write(text)
    print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
