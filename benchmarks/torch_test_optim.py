"""PyTorch's own ``test/test_optim.py`` with FusedAmpAdamW in the place of AdamW's ``optim_db`` entry.

torch's wheel ships ``torch.testing._internal.common_optimizers`` (``optim_db``, the AdamW
``OptimizerInfo``) but not ``test/test_optim.py``; this runner takes a copy of that file from a
PyTorch checkout (``--test-file``; it fetches nothing) and runs it under pytest once per backend:

    python -m benchmarks.torch_test_optim --test-file /path/to/pytorch/test/test_optim.py \\
        [--backends reference,cpu,triton] [--markdown FILE]

Before collection, the plugin half of this module (``-p benchmarks.torch_test_optim``) replaces the
``optim_cls`` of AdamW's ``OptimizerInfo`` with :class:`AdamW` below, FusedAmpAdamW on the backend
that ``AMPFUSED_TORCH_TEST_BACKEND`` names, under AdamW's class name so the test ids and test_optim's
name checks (``optim_cls.__name__ == "AdamW"``) are those of the AdamW entry, and drops "differentiable"
from the entry's ``supported_impls``: FusedAmpAdamW refuses ``differentiable=True`` (README, Known
limitations), and the entry declares what the class under test supports, as torch's entries for
optimizers without it do (``--keep-differentiable`` keeps it: 13 tests then stop at that refusal). The selection is
``TestOptimRenewed`` on the CPU device with ``AdamW`` in the test id (case-sensitive), which is every
test that AdamW's entry instantiates for ``cpu``; nothing else (other optimizers, torch's own
``test_adamw_serialization``, the lr-scheduler and SWA classes) is collected. test_optim.py imports
three sibling modules (``optim.test_lrscheduler``, ``optim.test_optim``, ``optim.test_swa_utils``);
where the copy sits without them, empty stand-ins are installed (none of their tests are in the selection).

The Triton backend runs through the Triton interpreter (``TRITON_INTERPRET=1``) on a CPU machine.
Needs ``expecttest`` (imported by ``torch.testing._internal``). Not collected by the repo's pytest.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import types
import xml.etree.ElementTree as ET
from pathlib import Path

ENV = "AMPFUSED_TORCH_TEST_BACKEND"
KEEP_DIFFERENTIABLE = "AMPFUSED_TORCH_TEST_KEEP_DIFFERENTIABLE"  # "1": the entry keeps torch's supported_impls
REPO = Path(__file__).resolve().parents[1]

# Test-id selection: the AdamW entry's tests on the CPU device (TestOptimRenewedCPU.test_*_AdamW_cpu_*).
SELECT = re.compile(r"^TestOptimRenewedCPU::test_\w*_AdamW_cpu\w*$")

# Why a failing test fails on purpose: the test's base name (no device/dtype suffix) -> the reason.
# Only tests whose failure message matches the pattern are classified; any other failure is "FAIL".
DELIBERATE = {
    "test_fused_error_on_params_on_meta": (
        r"materiali[sz]e",
        "meta-device params: step() raises ampfused's RuntimeError, which says to materialize them, not torch's "
        "'`fused=True` requires all the params to be floating point Tensors'"),
    "test_errors": (
        r"same parameter more than once",
        "a param listed twice in one group is refused with a ValueError where torch warns and steps it twice; "
        "the test stops there (the other inputs: 'test_errors, input by input' below)"),
}


def _fused_amp_adamw_as_adamw():
    import ampfused

    class AdamW(ampfused.FusedAmpAdamW):
        """FusedAmpAdamW on the backend named by $AMPFUSED_TORCH_TEST_BACKEND (None = auto)."""

        def __init__(self, params, *args, **kwargs):
            kwargs.setdefault("backend", os.environ.get(ENV) or None)
            super().__init__(params, *args, **kwargs)

    AdamW.__module__ = __name__
    return AdamW


# ---------------------------------------------------------------- pytest plugin half


def _install_sibling_stand_ins():
    """test_optim.py imports TestLRScheduler, TestDifferentiableOptimizer and TestSWAUtils from
    test/optim/; where those files are not beside the copy, empty TestCases stand in for them."""
    try:
        import optim.test_swa_utils  # noqa: F401  (a real test/optim/ beside the copy)
        return
    except ImportError:
        pass
    from torch.testing._internal.common_utils import TestCase

    package = types.ModuleType("optim")
    package.__path__ = []
    sys.modules["optim"] = package
    for module, cls in (("test_lrscheduler", "TestLRScheduler"), ("test_optim", "TestDifferentiableOptimizer"),
                        ("test_swa_utils", "TestSWAUtils")):
        mod = types.ModuleType(f"optim.{module}")
        setattr(mod, cls, type(cls, (TestCase,), {"__module__": mod.__name__}))
        sys.modules[mod.__name__] = mod
        setattr(package, module, mod)


def pytest_configure(config):
    import torch
    from torch.testing._internal.common_optimizers import optim_db

    entries = [info for info in optim_db if info.optim_cls is torch.optim.AdamW]
    assert len(entries) == 1, "optim_db has no single AdamW entry"
    entries[0].optim_cls = _fused_amp_adamw_as_adamw()
    # The entry declares what the class under test supports: FusedAmpAdamW refuses
    # differentiable=True (README, Known limitations), so "differentiable" leaves supported_impls, as
    # in torch's entries for optimizers without it; foreach/fused stay (accepted, the step is fused).
    if os.environ.get(KEEP_DIFFERENTIABLE) != "1":
        entries[0].supported_impls = tuple(i for i in entries[0].supported_impls if i != "differentiable")
    config.addinivalue_line("markers", "serial: torch's serialTest marker")
    _install_sibling_stand_ins()


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if SELECT.match(item.nodeid.split("::", 1)[-1])]
    drop = [item for item in items if item not in keep]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ---------------------------------------------------------------- runner half


def run_backend(test_file: Path, backend: str, xml: Path, extra: list[str], keep_differentiable=False) -> tuple[int, str]:
    env = dict(os.environ, **{ENV: backend, KEEP_DIFFERENTIABLE: "1" if keep_differentiable else "0"}, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pytest", str(test_file), "-p", "benchmarks.torch_test_optim",
           "-c", os.devnull, "--rootdir", str(test_file.parent), "-p", "no:cacheprovider",
           "-q", "-rfE", "--tb=line", f"--junitxml={xml}", *extra]
    proc = subprocess.run(cmd, cwd=test_file.parent, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def read_junit(xml: Path) -> dict[str, tuple[str, str]]:
    """test name -> (outcome, message)."""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip()
                break
        out[case.get("name")] = (outcome, message)
    return out


def error_inputs(backend: str) -> list[tuple[str, str, str]]:
    """test_errors stops at its first miss; this walks all of AdamW's error inputs as it does (construction
    or step, error type and regex) on one backend: (description, what torch expects, what ampfused did)."""
    import warnings

    from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_error_inputs_func_adamw

    os.environ[ENV] = backend
    cls = _fused_amp_adamw_as_adamw()
    out = []
    for ei in optim_error_inputs_func_adamw(device="cpu", dtype=__import__("torch").float32):
        oi = ei.optimizer_error_input
        expected = f"{ei.error_type.__name__} at {'construction' if ei.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR else 'step'}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt = cls(oi.params, **oi.kwargs)
                if ei.error_on == OptimizerErrorEnum.STEP_ERROR:
                    opt.step()
                hit = [w for w in caught if issubclass(w.category, ei.error_type) and re.search(ei.error_regex, str(w.message))]
                got = "same (warned)" if hit else "accepted"
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, ei.error_type) and re.search(ei.error_regex, str(exc)):
                    got = "same"
                elif oi.params is None and isinstance(exc, TypeError) and "NoneType" in str(exc):
                    got = "accepted (the input's params=None then fails to iterate)"
                else:
                    got = f"{type(exc).__name__}: {str(exc)[:120]}"
        out.append((oi.desc or ei.error_regex, expected, got))
    return out


def base_name(test: str) -> str:
    return re.sub(r"_AdamW_cpu.*$", "", test)


REFUSED_DIFFERENTIABLE = (r"differentiable=True is not supported",
                          "differentiable=True is refused (the step runs outside autograd); --keep-differentiable only")


def why_deliberate(test: str, message: str) -> str | None:
    pattern, why = DELIBERATE.get(base_name(test), (None, None))
    if pattern and re.search(pattern, message):
        return why
    return REFUSED_DIFFERENTIABLE[1] if re.search(REFUSED_DIFFERENTIABLE[0], message) else None


def classify(test: str, outcome: str, message: str) -> str:
    if outcome in ("passed", "skipped"):
        return outcome
    return "deliberate" if why_deliberate(test, message) else "FAIL"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--test-file", required=True, type=Path, help="path of a copy of PyTorch's test/test_optim.py")
    parser.add_argument("--backends", default="reference,cpu,triton", help="comma-separated backends")
    parser.add_argument("--markdown", default=None, help="also write the per-test table to this file")
    parser.add_argument("--workdir", default="/tmp/ampfused_torch_test_optim", type=Path, help="junit XML files go here")
    parser.add_argument("--keep-differentiable", action="store_true",
                        help="leave 'differentiable' in the entry's supported_impls: the tests that add "
                             "differentiable=True configs then fail on FusedAmpAdamW's refusal of it")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before ampfused's Triton kernels are imported)
    import torch

    test_file = args.test_file.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    backends = [b for b in args.backends.split(",") if b]
    results, summaries = {}, {}
    for backend in backends:
        xml = args.workdir / f"{backend}.xml"
        rc, output = run_backend(test_file, backend, xml, args.pytest_args, args.keep_differentiable)
        tail = output.strip().splitlines()[-1] if output.strip() else ""
        print(f"[{backend}] pytest exit {rc}: {tail}", flush=True)
        if not xml.exists():
            print(output)
            raise SystemExit(f"{backend}: pytest wrote no report")
        results[backend] = {name: classify(name, *res) + "\t" + res[1] for name, res in read_junit(xml).items()}
        summaries[backend] = tail
    names = sorted(set().union(*results.values()))
    lines = [f"| test | {' | '.join(backends)} |", "|---|" + "---|" * len(backends)]
    for name in names:
        cells = [results[b].get(name, "-\t").split("\t")[0] for b in backends]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    counts = []
    for b in backends:
        kinds = [v.split("\t")[0] for v in results[b].values()]
        counts.append(f"{b}: {len(kinds)} selected: {kinds.count('passed')} passed, "
                      f"{kinds.count('deliberate')} fail by design, {kinds.count('FAIL')} fail, "
                      f"{kinds.count('skipped')} skipped (pytest: {summaries[b]})")
    failures = []
    for b in backends:
        for name in names:
            kind, _, message = results[b].get(name, "-\t").partition("\t")
            if kind in ("deliberate", "FAIL"):
                why = why_deliberate(name, message) if kind == "deliberate" else ""
                failures.append(f"- {b} `{name}`: {kind}{': ' + why if why else ''} — `{message.splitlines()[0][:200] if message else ''}`")
    errors = []
    for b in backends:
        rows = error_inputs(b)
        differ = [f"{d} (torch: {e}): {g}" for d, e, g in rows if not g.startswith("same")]
        errors.append(f"- {b}: {len(rows) - len(differ)} of {len(rows)} of AdamW's error inputs give torch's error; "
                      f"differ: {'; '.join(differ) or 'none'}")
    text = "\n".join(lines + [""] + counts + [""] + failures + ["", "test_errors, input by input:"] + errors) + "\n"
    print(text)
    if args.markdown:
        header = (f"<!-- written by benchmarks/torch_test_optim.py on {datetime.date.today()} with torch "
                  f"{torch.__version__}; test file {test_file} -->\n")
        Path(args.markdown).write_text(header + text)
    return 0 if all(v.split("\t")[0] != "FAIL" for r in results.values() for v in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
