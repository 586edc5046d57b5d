"""`python -m ampfused ...` fails politely: every bad argument is an argparse error (exit status 2, one
error line naming the problem, no traceback), and the help and version a user looks for are there."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampfused
from ampfused.__main__ import main


def run_main(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--sizes", "abc"], "argument --sizes: 'abc' is not a size"),
    (["bench", "--sizes", "0"], "argument --sizes: '0': a size is at least 1"),
    (["bench", "--sweeps", "nope"], "argument --sweeps: unknown 'nope'; choose from configs, size, tensors, host, memory"),
    (["bench", "--sweeps", "passes"], "argument --sweeps: unknown 'passes'"),  # a study now: benchmarks/passes.py
    (["bench", "--sweeps", ""], "argument --sweeps: unknown empty list"),
    (["bench", "--backends", "nope"], "argument --backends: unknown 'nope'; choose from cuda, triton, cpu, reference"),
    (["bench", "--threads", "0"], "argument --threads: '0': must be at least 1"),
    (["bench", "--gate-steps", "x"], "argument --gate-steps: 'x' is not an integer"),
    (["bench", "--max-spread", "-1"], "argument --max-spread: '-1': must be above 0"),
    (["bench", "--sweeps", "configs", "--sizes", "1M"], "--sizes sets the size and memory sweeps, which --sweeps leaves out"),
    (["bench", "--bogus"], "unrecognized arguments: --bogus"),
    (["info", "--bogus"], "info takes no arguments: --bogus"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["bench", "train"], "the end-to-end training benchmark is not installed; from a checkout: "
                         "python benchmarks/bench_train.py"),
])
def test_bad_arguments_are_argparse_errors(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: '0': must be at least 1"),
    (["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
    (["--tolerance", "abc"], "argument --tolerance: 'abc' is not a number"),
    (["--modes", "split4"], "argument --modes: unknown 'split4'; choose from none, split16, split8"),
])
def test_bad_arguments_of_the_training_benchmark_are_argparse_errors(capsys, argv, message):
    bench_train = _bench_train()
    with pytest.raises(SystemExit) as exit_info:
        bench_train.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.startswith("usage: python benchmarks/bench_train.py ")


def _bench_train():
    """The checkout's training benchmark (benchmarks/ is not installed), loaded from its file."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("ampfused_study_bench_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("command", [["bench"], ["train"]])
def test_device_cuda_without_cuda_says_so(capsys, command):
    if command == ["train"]:
        with pytest.raises(SystemExit) as exit_info:
            _bench_train().main(["--device", "cuda"])
        code, err = exit_info.value.code, capsys.readouterr().err
    else:
        code, _, err = run_main(capsys, *command, "--device", "cuda")
    assert code == 2
    assert "--device cuda: CUDA is not available" in err and "Traceback" not in err


def test_requested_backend_that_cannot_run_is_an_error(capsys):
    code, _, err = run_main(capsys, "bench", "--device", "cpu", "--backends", "cuda")
    assert code == 2
    assert "--backends: none of the requested backends can run here: cuda:" in err


def test_version(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip() == f"ampfused {ampfused.__version__}"


def test_help_lists_every_command(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    commands = {line.split()[0] for line in out.splitlines()
                if line.startswith("  ") and line.split() and line.split()[0] in ("info", "check", "bench")}
    assert commands == {"info", "check", "bench"}, out
    assert "python benchmarks/bench_train.py" in out  # where the training benchmark went


def test_subcommand_help(capsys):
    code, out, _ = run_main(capsys, "bench", "--help")
    assert code == 0 and out.startswith("usage: python -m ampfused bench ")


def test_bad_argument_from_a_shell_has_no_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "ampfused", "bench", "--sizes", "abc"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "python -m ampfused bench: error: argument --sizes: 'abc' is not a size (examples: 4096, 64K, 1M, 1.5B)")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("cuda_version", [None, "12.8"])
def test_info_advice_fits_the_torch_build(capsys, monkeypatch, cuda_version):
    """On a GPU machine torch cannot use, a CPU-only torch is told to get a CUDA build of torch; a CUDA
    torch with a CPU-only ampfused._C is told how to rebuild ampfused."""
    from ampfused import _backends, _gpu_advice

    if torch.cuda.is_available():
        pytest.skip("checks the advice on a machine without CUDA")
    monkeypatch.setattr(_gpu_advice, "machine_has_gpu", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(_backends, "_probed", {})
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    cuda_line = next(line for line in out.splitlines() if line.startswith("  cuda "))
    if cuda_version is None:
        assert "needs a CUDA build of torch" in cuda_line and "AMPFUSED_BUILD_CUDA" not in out, out
    elif "ampfused._C" in cuda_line:  # (a build without the extension says that instead)
        assert "AMPFUSED_BUILD_CUDA=1" in cuda_line, out
    assert "auto backend for cpu: " in out


# ------------------------------------------------------------------ a machine without a GPU


@pytest.fixture
def no_gpu(monkeypatch):
    """This process on a machine with no GPU at all (whatever the test machine has)."""
    from ampfused import _backends, _gpu_advice

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: the CUDA backends would really serve")
    monkeypatch.setattr(_gpu_advice, "machine_has_gpu", lambda: False)
    monkeypatch.setattr(_backends, "_probed", {})
    return _gpu_advice


def assert_plain_no_gpu_advice(text: str, gpu_advice):
    """Says the GPU backends need a GPU, gives the install command for one, and calls nothing broken."""
    assert "this machine has none" in text and gpu_advice.no_gpu_note() in text, text
    assert "pip install torch==2.13.0" in text and "pip install --no-build-isolation -e ." in text
    for wrong in ("reinstall", "broken", "install one", "not a CUDA build"):
        assert wrong not in text, (wrong, text)


def readme_install_args():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(line for line in readme.splitlines() if "pip install --no-build-isolation -e ." in line)
    return line.split("pip install --no-build-isolation -e .", 1)[1].strip()


def test_the_gpu_install_command_is_readmes(no_gpu):
    assert f"pip install --no-build-isolation -e . {readme_install_args()}`" in no_gpu.GPU_INSTALL


@pytest.mark.parametrize("interpreter", [False, True], ids=["plain", "TRITON_INTERPRET"])
def test_info_without_a_gpu_says_what_the_gpu_backends_need(capsys, monkeypatch, no_gpu, interpreter):
    from ampfused import _backends

    if not interpreter:  # the Triton backend as it probes without the interpreter on a CPU machine
        real = _backends.probe("triton")[0]
        if real is not None:
            monkeypatch.setattr(real, "supports", lambda device: "needs TRITON_INTERPRET=1 on CPU tensors")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "needs an NVIDIA GPU, and this machine has none" in lines["cuda"]
    triton = lines["triton"]
    assert "TRITON_INTERPRET=1" in triton and "for testing only: far too slow to benchmark" in triton, triton
    if interpreter and _backends.probe("triton")[0] is not None:
        assert "available on CPU tensors" in triton
    else:
        assert "needs a GPU, and this machine has none" in triton
    assert "cuda available: False (this machine has no GPU)" in out
    assert_plain_no_gpu_advice(out, no_gpu)


def test_check_without_a_gpu_says_what_the_gpu_backends_need(capsys, monkeypatch, no_gpu):
    from ampfused import _backends, check

    monkeypatch.setattr(check, "CASES", check.CASES[:1])  # one quick case: the lines about backends are checked
    monkeypatch.setitem(_backends._probed, "triton", (None, "triton is not installed"))
    assert check.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cuda: not checked: needs an NVIDIA GPU, and this machine has none" in out
    assert "triton: not checked: needs a GPU, and this machine has none; TRITON_INTERPRET=1" in out
    assert_plain_no_gpu_advice(out, no_gpu)


def test_bench_without_a_gpu_says_what_the_gpu_backends_need(no_gpu):
    from ampfused.bench import bench

    chosen, skipped = bench.ampfused_backends(torch.device("cpu"), None, interpreter=False)
    assert "cuda" not in chosen and "triton" not in chosen
    assert skipped["cuda"] == "needs an NVIDIA GPU, and this machine has none"
    assert skipped["triton"].startswith("needs a GPU, and this machine has none; TRITON_INTERPRET=1 ")
    assert "far too slow to benchmark" in skipped["triton"]


def test_bench_on_a_gpu_machine_keeps_the_probes_reasons(monkeypatch):
    from ampfused import _gpu_advice
    from ampfused.bench import bench

    monkeypatch.setattr(_gpu_advice, "machine_has_gpu", lambda: True)
    _, skipped = bench.ampfused_backends(torch.device("cpu"), None, interpreter=False)
    assert skipped["triton"] == _gpu_advice.INTERPRETER + " (--triton-interpreter runs it anyway)"
    assert "this machine has none" not in skipped.get("cuda", "")
