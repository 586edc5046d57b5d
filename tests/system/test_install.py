"""Both installs serve ``ampfused.kernels`` from the top-level ``kernels/`` (DESIGN §5), and nothing
else of the checkout becomes a top-level package.

The checkout's files (tracked and not ignored) are copied to a scratch folder and installed from
there with pip, as README's commands do, without the compiled extension (AMPFUSED_BUILD_EXTENSION=0:
this is about where Python files land). Each install goes into its own ``--target`` folder, not a
virtual environment: a venv made from inside this one would not see its torch. Each check runs in a
fresh interpreter outside the checkout, with the editable finder of the environment's own install
removed, so only the install under test can answer ``import ampfused``.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_PACKAGES = ("kernels", "benchmarks", "tests")  # checkout folders that must not install as packages

PROBE = """
import importlib.util, json, sys
sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', ''))]
{setup}
import ampfused.kernels
print(json.dumps({{"ampfused": ampfused.__file__, "kernels": ampfused.kernels.__file__,
                  "host_only": hasattr(ampfused.kernels, "host_only"),
                  "others": {{n: getattr(importlib.util.find_spec(n), "origin", None) for n in {names!r}}}}}))
"""


def _pip(*args, cwd):
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs pip and setuptools in this environment")
    # no PYTHONPATH: with a checkout on it, its top-level kernels/ would shadow any installed `kernels`
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "AMPFUSED_BUILD_EXTENSION": "0"}
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--no-index", "-q"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _probe(setup: str, cwd: Path, pythonpath: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = PROBE.format(setup=setup, names=NOT_PACKAGES)
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of this checkout's files (what git tracks or would track), so builds leave it untouched."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the file list is read from git")
    copy = tmp_path_factory.mktemp("checkout")
    for name in out.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


def _assert_served_from(result: dict, package_dir: Path, kernels_dir: Path, *roots: Path):
    assert Path(result["ampfused"]) == package_dir / "__init__.py"
    assert Path(result["kernels"]) == kernels_dir / "__init__.py"
    assert result["host_only"]  # the benchmark's documented seam is there
    for name, origin in result["others"].items():  # not importable from the install or the checkout
        assert origin is None or not any(origin.startswith(str(r)) for r in roots), (name, origin)


def test_wheel_holds_the_kernels_inside_ampfused_and_nothing_else_top_level(checkout, tmp_path):
    _pip("wheel", "-w", str(tmp_path), str(checkout), cwd=tmp_path)
    (wheel,) = tmp_path.glob("ampfused-*.whl")
    parts = [PurePosixPath(n).parts for n in zipfile.ZipFile(wheel).namelist()]
    assert {p[0] for p in parts} == {"ampfused", wheel.name.split("-py")[0] + ".dist-info"}
    shipped = {p[2] for p in parts if p[:2] == ("ampfused", "kernels") and len(p) == 3}
    assert shipped == {p.name for p in (ROOT / "kernels").glob("*.py")}
    assert not [p for p in parts if p[:2] in (("ampfused", "benchmarks"), ("ampfused", "tests"))]
    # the installed bench is the step benchmark alone: the studies of benchmarks/ stay in the checkout
    bench = {p[2] for p in parts if p[:2] == ("ampfused", "bench") and len(p) == 3}
    assert bench == {p.name for p in (ROOT / "ampfused" / "bench").glob("*.py")}
    assert not bench & {p.name for p in (ROOT / "benchmarks").glob("*.py")}


def test_regular_install_imports_the_installed_kernels(checkout, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(checkout), cwd=tmp_path)
    assert not [p.name for p in target.iterdir() if p.name in NOT_PACKAGES]
    result = _probe(f"sys.path.insert(0, {str(target)!r})", cwd=tmp_path)
    _assert_served_from(result, target / "ampfused", target / "ampfused" / "kernels", target, checkout)


def test_editable_install_maps_the_kernels_to_the_checkout(checkout, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--target", str(target), "-e", str(checkout), cwd=tmp_path)
    assert not [p.name for p in target.iterdir() if p.name in NOT_PACKAGES]
    (finder,) = target.glob("__editable___*_finder.py")
    mapping = {}
    for line in finder.read_text().splitlines():
        if line.startswith("MAPPING"):
            mapping = eval(line.split("=", 1)[1])  # noqa: S307 -- a dict literal setuptools wrote
    assert mapping == {"ampfused": str(checkout / "ampfused"), "ampfused.kernels": str(checkout / "kernels")}
    # the install's .pth imports its finder module, which has the name of the environment's own: that
    # one is dropped from sys.modules and the target searched first
    # (an environment whose own install is strict puts its link tree on sys.path instead: dropped too)
    setup = ("sys.path[:] = [p for p in sys.path if '__editable__' not in p]\n"
             f"sys.path.insert(0, {str(target)!r})\n"
             "for m in [m for m in sys.modules if m.startswith('__editable__')]: del sys.modules[m]\n"
             f"import site; site.addsitedir({str(target)!r})")
    result = _probe(setup, cwd=tmp_path)
    _assert_served_from(result, checkout / "ampfused", checkout / "kernels", target, checkout)


def test_checkout_on_the_path_imports_its_own_kernels(checkout, tmp_path):
    """PYTHONPATH=<checkout>, run from elsewhere: ampfused finds the top-level kernels/ by itself."""
    result = _probe("", cwd=tmp_path, pythonpath=str(checkout))
    assert Path(result["ampfused"]) == checkout / "ampfused" / "__init__.py"
    assert Path(result["kernels"]) == checkout / "kernels" / "__init__.py"


def readme_editable_install() -> list[str]:
    """The arguments after `pip install` of README's editable install command (its config settings too)."""
    for line in (ROOT / "README.md").read_text().splitlines():
        for command in line.split("&&"):
            words = command.split()
            if words[:2] == ["pip", "install"] and "-e" in words:
                return words[2:]
    raise AssertionError("README.md has no `pip install ... -e .` command")


def test_readme_editable_install_serves_the_folder_that_holds_a_checkout_named_ampfused(checkout, tmp_path):
    """Python run from the folder that contains the checkout puts that folder first on sys.path, where the
    checkout (no __init__.py) would be a namespace package `ampfused` ahead of a finder-based editable
    install; README's install must make `python -m ampfused info` and `import ampfused` work there too."""
    parent = tmp_path / "work"
    clone = parent / "ampfused"  # what `git clone` names it
    shutil.copytree(checkout, clone)
    venv = tmp_path / "venv"
    try:  # a fresh environment, without pip of its own (this one's pip installs into it)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make a virtual environment here: {exc}")
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # torch, setuptools and pip come from this environment as a plain path entry: its own .pth files
    # (the editable finder of the install under test here) are not run there
    site = Path(importlib.util.find_spec("torch").origin).parents[1]
    (Path(purelib) / "this-env.pth").write_text(f"{site}\n")
    args = [str(clone) if a == "." else a for a in readme_editable_install()]
    _pip("--python", python, "install", *args, cwd=parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    info = subprocess.run([python, "-m", "ampfused", "info"], cwd=parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert info.returncode == 0, info.stdout + info.stderr
    assert info.stdout.startswith("ampfused 0.1.0 ") and "reference  available" in info.stdout, info.stdout
    probe = subprocess.run([python, "-c", "import ampfused, ampfused.kernels, importlib.util as u; "
                            "print(ampfused.FusedAmpAdamW.__module__, ampfused.kernels.__file__, u.find_spec('kernels'))"],
                           cwd=parent, env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    module, kernels, top_level_kernels = probe.stdout.split()
    assert module == "ampfused.optim" and Path(kernels).resolve() == clone / "kernels" / "__init__.py"
    assert top_level_kernels == "None"  # the install adds no other top-level package
