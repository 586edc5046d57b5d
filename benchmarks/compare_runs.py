"""Do two runs of `python -m ampfused bench` tell the same story? Compares every ratio to torch-fused
(step speedups and host-time ratios) that both runs' ``bench.csv`` hold, row by row, and prints how
many agree within a tolerance, with the rows that do not.

    python benchmarks/compare_runs.py IDLE_DIR BUSY_DIR [--tolerance 0.15] [--markdown]

Each DIR is a bench ``--out`` folder (or its ``bench.csv``). Ratios, not milliseconds, are compared:
a neighbour slows both sides of a ratio alike, so a run that tells the truth under load keeps them.
"""
from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

RATIOS = {"speedup_vs_torch_fused": "step speedup", "host_ratio_vs_torch_fused": "host ratio"}


def load(path: Path) -> list[dict]:
    """The rows of one run's ``bench.csv`` (``path``: the ``--out`` folder or the file)."""
    with open(path / "bench.csv" if path.is_dir() else path, newline="") as f:
        return list(csv.DictReader(f))


def ratios(rows: list[dict]) -> dict[tuple[str, str, str], float]:
    """(ratio column, case, provider) -> value, for every gated row of one run."""
    out = {}
    for row in rows:
        if row["status"] != "ok" or row["provider"] == "torch-fused":
            continue
        for column in RATIOS:
            try:
                out[(column, row["case"], row["provider"])] = float(row[column])
            except (KeyError, ValueError):
                continue
    return out


def header(rows: list[dict]) -> str:
    """When the run started, on how many threads, and the load average then (its first row)."""
    return f"{rows[0]['date']}, {rows[0]['threads']} thread(s), load average {rows[0]['loadavg']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="the run to compare against (e.g. idle)")
    parser.add_argument("other", type=Path, help="the run under test (e.g. with a busy neighbour)")
    parser.add_argument("--tolerance", type=float, default=0.15, help="relative agreement asked for (default 0.15)")
    parser.add_argument("--markdown", action="store_true", help="print the disagreeing rows as a markdown table")
    args = parser.parse_args(argv)
    ref_rows, other_rows = load(args.reference), load(args.other)
    ref, other = ratios(ref_rows), ratios(other_rows)
    shared = sorted(set(ref) & set(other))
    if not shared:
        parser.error("the two runs share no gated ratio")
    quotients = {key: other[key] / ref[key] for key in shared if ref[key] > 0}
    print(f"reference: {header(ref_rows)}\nother:     {header(other_rows)}")
    for column, label in RATIOS.items():
        values = [q for key, q in quotients.items() if key[0] == column]
        if values:
            agree = sum(abs(q - 1) <= args.tolerance for q in values)
            print(f"{label}: {agree} of {len(values)} within {args.tolerance:.0%}; other/reference median "
                  f"{statistics.median(values):.3f}, range {min(values):.2f}-{max(values):.2f}")
    apart = sorted((q, key) for key, q in quotients.items() if abs(q - 1) > args.tolerance)
    if apart and args.markdown:
        print("\n| ratio | case | provider | reference | other | other/reference |\n|---|---|---|---:|---:|---:|")
        for q, (column, case, provider) in apart:
            print(f"| {RATIOS[column]} | {case} | {provider} | {ref[(column, case, provider)]:.2f} | "
                  f"{other[(column, case, provider)]:.2f} | {q:.2f} |")
    elif apart:
        for q, (column, case, provider) in apart:
            print(f"  {q:.2f}  {RATIOS[column]}: {case} | {provider}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
