"""`python -m ampfused info` lists the backends; `python -m ampfused bench` runs the benchmarks."""
from __future__ import annotations

import argparse
import platform
import sys


def info() -> int:
    import torch

    from . import __version__, _backends

    print(f"ampfused {__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"cuda available: {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))
    for name, available, reason in _backends.report():
        print(f"  {name:<10} {'available' if available else 'unavailable'}{': ' + reason if reason else ''}")
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        module, why = _backends.resolve(None, torch.device(device))
        print(f"auto backend for {device}: {module.NAME} ({why})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ampfused")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list the backends found and why any is missing")
    sub.add_parser("bench", help="benchmark against the stock torch.amp path (extra arguments: --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        return info()
    from .benchmarks import bench

    return bench.main(rest)


if __name__ == "__main__":
    sys.exit(main())
