"""`python -m ampfused info|check|bench`: the backends found, their check, and the step benchmark."""
from __future__ import annotations

import argparse
import platform
import sys
import warnings

COMMANDS = """commands:
  info          list the backends found and why any is missing
  check         run every available backend against the reference on small problems on this
                device; exit status 1 on any failure (python -m ampfused check --help)
  bench         benchmark the optimizer step against the stock torch.amp path
                (python -m ampfused bench --help for its options; the training
                benchmark runs from a checkout: python benchmarks/bench_train.py,
                the studies too: benchmarks/README.md)"""


def info() -> int:
    import torch

    from . import __version__, _backends, _gpu_advice

    no_gpu = not _gpu_advice.machine_has_gpu()
    print(f"ampfused {__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"cuda available: {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available()
                                                            else " (this machine has no GPU)" if no_gpu else ""))
    for name, available, reason in _backends.report():
        status = "available" if available else "unavailable"
        if no_gpu and name in _gpu_advice.GPU_BACKENDS:  # nothing is broken: say what the backend needs
            status, reason = ("available on CPU tensors", _gpu_advice.INTERPRETER) if available else \
                ("not on this machine", _gpu_advice.no_gpu_reason(name))
        print(f"  {name:<10} {status}{': ' + reason if reason else ''}")
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        with warnings.catch_warnings():  # the fallback warning would repeat what the line says
            warnings.simplefilter("ignore")
            module, why = _backends.resolve(None, torch.device(device))
        print(f"auto backend for {device}: {module.NAME} ({why.removeprefix(module.NAME + ': ')})")
    if no_gpu:
        print(_gpu_advice.no_gpu_note())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="python -m ampfused", description="ampfused: fused mixed-precision AdamW "
                                     "and GradScaler for PyTorch", epilog=COMMANDS,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ampfused {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,check,bench}")
    sub.add_parser("info", help="list the backends found and why any is missing")
    sub.add_parser("check", help="every available backend against the reference (see below)", add_help=False)
    # bench parses its own arguments, --help included
    sub.add_parser("bench", help="benchmarks (see below)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        if rest:
            parser.error(f"info takes no arguments: {' '.join(rest)}")
        return info()
    if args.command == "check":  # parses its own arguments, --help included
        from . import check

        return check.main(rest)
    from .bench import bench

    return bench.main(rest)


if __name__ == "__main__":
    sys.exit(main())
