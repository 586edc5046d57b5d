"""`bench busy` left the installed package: the busy-cores study runs from a checkout,
``python benchmarks/busy.py`` (benchmarks/README.md)."""
import sys

MOVED = "the busy-cores study is not installed; from a checkout: python benchmarks/busy.py"


def main(argv=None) -> int:
    print(f"python -m ampfused bench busy: error: {MOVED}", file=sys.stderr)
    return 2
