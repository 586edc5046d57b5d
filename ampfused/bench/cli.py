"""Argument types and checks shared by the benchmark command lines: every bad value is an argparse error
(exit status 2, one line on stderr, no traceback)."""
from __future__ import annotations

import argparse
import sys

import torch

BENCH_EXTRA_HINT = 'pip install "ampfused[bench]"'


def parse_size(text: str) -> int:
    """'4M' -> 4_000_000; K, M, B/G suffixes, plain integers, or a float with a suffix ('1.5M')."""
    units = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
    text, upper = text.strip(), text.strip().upper()
    try:
        value = float(upper[:-1]) * units[upper[-1]] if upper and upper[-1] in units else float(upper)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 4096, 64K, 1M, 1.5B)") from None
    if not value >= 1 or value != value:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is at least 1")
    return int(value)


def size_list(text: str) -> tuple[int, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected a comma list of sizes, e.g. 1M,10M")
    return tuple(parse_size(p) for p in parts)


def choice_list(choices) -> callable:
    """A type for comma lists whose items must come from ``choices`` (order kept, duplicates dropped)."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
        unknown = [p for p in items if p not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown)) or 'empty list'}; choose from {', '.join(choices)}")
        return items

    return parse


def _number(kind, least: float, rule: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value >= least or (kind is float and value == least):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {rule}")
        return value

    return parse


positive_int = _number(int, 1, "at least 1")
fraction = _number(float, 0.0, "above 0")


def pick_device(parser: argparse.ArgumentParser, requested: str | None) -> torch.device:
    """The device to run on; ``--device cuda`` without a usable GPU is an argument error that says why."""
    if requested == "cuda" and not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else "no CUDA device is visible")
        parser.error(f"--device cuda: CUDA is not available ({why})")
    return torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


class Progress:
    """tqdm's progress bar when tqdm is installed, else a line per finished case on stderr."""

    def __init__(self, total: int, unit: str):
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True)
        self.total, self.done, self.text = total, 0, ""

    def describe(self, text: str) -> None:
        self.text = text
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is None:
            print(f"[{self.done}/{self.total}] {self.text}", file=sys.stderr, flush=True)
        else:
            self.bar.total = max(self.bar.total, self.done)  # (more rounds than planned)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
