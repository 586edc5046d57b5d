"""How setup.py builds the compiled extension ``ampfused._C`` (loaded by file path from setup.py).

``extension_kwargs()`` returns ``{"ext_modules": [...], "cmdclass": {"build_ext": ...}}``, or ``{}``
(a pure-Python install) after saying why. Environment knobs:

``AMPFUSED_BUILD_CUDA=auto|0|1``
    ``auto`` (default): CUDA kernels when torch is a CUDA build and an nvcc of the same major
    version is found; ``0``: CPU kernels only; ``1``: CUDA kernels or a loud failure saying why.
``AMPFUSED_BUILD_EXTENSION=0``
    no extension at all (pure Python, as an isolated ``pip install .``).
``TORCH_CUDA_ARCH_LIST``
    as for any torch extension; when unset and no GPU is visible, ``8.0;9.0+PTX``.
``CUDA_HOME`` / ``CUDA_PATH``, ``MAX_JOBS``
    as for any torch extension (``MAX_JOBS`` is honoured by ninja builds).

[note: torch is not a build requirement] pyproject.toml does not list torch, so an isolated build
sees none and installs pure Python; ``pip install --no-build-isolation .`` builds against the torch
the user has, as apex, flash-attn and torchao do.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

CSRC = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(CSRC)

CPU_SOURCES = [
    "ops.cpp",
    "ops_common.cpp",
    "accumulate_hook.cpp",
    "cpu/ops_cpu.cpp",
    "cpu/kernels_base.cpp",
    "cpu/kernels_avx2.cpp",
    "cpu/kernels_avx2_div.cpp",
    "cpu/kernels_avx512.cpp",
    "cpu/kernels_avx512_div.cpp",
]
CUDA_SOURCES = ["cuda/ops_cuda.cpp", "cuda/passes.cu"]
# The test-only extension (tests/testing_extension.py builds it on demand; never installed).
TESTING_SOURCES = [
    "testing/testing_ops.cpp",
    "testing/division_base.cpp",
    "testing/division_avx2.cpp",
    "testing/division_avx512.cpp",
]
# torch.utils.cpp_extension adds the standard its headers need (C++17 or C++20).
# -ffp-contract=off: no multiply-add fused that torch does not fuse (csrc/adamw_math.h).
# -fno-trapping-math (clang's default) lets GCC compute a float operation
# that only one side of a select uses, as vector code does: without it GCC keeps such operations
# (the int8 codecs' grid rounding) under a branch, and the AVX2 build of the int8 loops stayed
# scalar (ns per element before and after: docs/results/compact-cpu-speed.md). Values are unchanged: no exception flag is read anywhere, and
# nothing here depends on signaling NaNs (test_cpu_isa holds every build bitwise equal).
CXX_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
HOW_TO = "for the compiled kernels run `pip install --no-build-isolation .` in an environment that has torch"


def say(message: str) -> None:
    print(f"ampfused build: {message}", file=sys.stderr, flush=True)


def _source(path: str) -> str:
    full = os.path.join(CSRC, path)
    # setuptools wants sources relative to the project directory when it can have them
    return os.path.relpath(full, ROOT) if os.path.abspath(os.getcwd()) == ROOT else full


def nvcc_version(nvcc: str) -> str | None:
    """'13.0' from `nvcc --version`, or None."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _home_of(nvcc: str) -> str | None:
    """The toolkit directory of an nvcc, seeing through symlinks and wrapper scripts."""
    real = os.path.realpath(nvcc)
    home = os.path.dirname(os.path.dirname(real))
    if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")) or os.path.exists(
        os.path.join(home, "targets", "x86_64-linux", "include", "cuda_runtime.h")
    ):
        return home
    # A wrapper script (e.g. /usr/local/bin/nvcc doing `exec /usr/local/cuda-X/bin/nvcc "$@"`): ask
    # the real driver where it lives; --dryrun prints its environment, _HERE_ among it.
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    return os.path.dirname(match.group(1).strip()) if match else None


def find_cuda_home() -> tuple[str | None, str]:
    """(toolkit directory, how it was found) or (None, why not)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if os.path.exists(os.path.join(home, "bin", "nvcc")):
                return home, f"${var}"
            return None, f"${var}={home} has no bin/nvcc"
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = _home_of(nvcc)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home, f"nvcc on PATH ({nvcc})"
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda", "/usr/local/cuda"
    return None, "no nvcc on PATH, no CUDA_HOME/CUDA_PATH, no /usr/local/cuda"


def cuda_plan(torch) -> tuple[str | None, str]:
    """(CUDA_HOME to build with, "") or (None, why the CUDA kernels are not built)."""
    mode = os.environ.get("AMPFUSED_BUILD_CUDA", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"AMPFUSED_BUILD_CUDA={mode!r}: use auto, 0 or 1")
    if mode == "0":
        return None, "AMPFUSED_BUILD_CUDA=0"
    home, why = None, ""
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is not a CUDA build"
    else:
        home, how = find_cuda_home()
        if home is None:
            why = f"no CUDA toolkit found: {how}"
        else:
            version = nvcc_version(os.path.join(home, "bin", "nvcc"))
            if version is None:
                why, home = f"{home}/bin/nvcc --version did not run", None
            elif version.split(".")[0] != torch.version.cuda.split(".")[0]:
                why, home = f"nvcc {version} in {home} does not match torch's CUDA {torch.version.cuda}", None
            else:
                say(f"CUDA kernels: nvcc {version} in {home} (found via {how}), torch CUDA {torch.version.cuda}")
    if home is None and mode == "1":
        raise RuntimeError(f"AMPFUSED_BUILD_CUDA=1 but the CUDA kernels cannot be built: {why}")
    return home, why


def openmp_flags(torch) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) that give ``at::parallel_for`` inside _C torch's own threads.

    ATen's OpenMP backend inlines ``#pragma omp parallel`` into the
    caller, so an extension compiled without ``-fopenmp`` runs every parallel_for on one thread.
    We compile with it and link the libgomp torch ships (same soname, already loaded by
    libtorch_cpu), never a second runtime; without a bundled one, the compiler's, which is what
    torch was linked against then. A torch on its native thread pool needs neither.
    """
    info = torch.__config__.parallel_info()
    if "parallel backend: OpenMP" not in info or sys.platform == "darwin" or os.name == "nt":
        say("torch does not run ATen on OpenMP here: _C uses torch's own thread pool")
        return [], []
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    bundled = sorted(f for f in os.listdir(lib) if re.fullmatch(r"libgomp(-[0-9a-f]+)?\.so(\.\d+)*", f)) if os.path.isdir(lib) else []
    if bundled:
        say(f"OpenMP: -fopenmp, linking torch's {os.path.join(lib, bundled[0])}")
        return ["-fopenmp"], [os.path.join(lib, bundled[0])]
    say("OpenMP: -fopenmp with the compiler's libgomp (torch bundles none)")
    return ["-fopenmp"], ["-fopenmp"]


def extension_kwargs() -> dict:
    if os.environ.get("AMPFUSED_BUILD_EXTENSION", "1").strip() == "0":
        say(f"AMPFUSED_BUILD_EXTENSION=0: pure-Python install; {HOW_TO}")
        return {}
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken torch install
        say(f"torch is not importable at build time ({type(exc).__name__}: {exc}): installing pure Python "
            f"(the Triton and reference backends still work); {HOW_TO} (note --no-build-isolation)")
        return {}
    cuda_home, why_not = cuda_plan(torch)
    if cuda_home is not None:
        # torch.utils.cpp_extension reads CUDA_HOME at import
        # and derives it from `which nvcc` without resolving wrapper scripts.
        os.environ["CUDA_HOME"] = cuda_home
    from torch.utils import cpp_extension

    sources = [_source(s) for s in CPU_SOURCES]
    cxx = list(CXX_FLAGS)
    openmp_cxx, openmp_link = openmp_flags(torch)
    cxx += openmp_cxx
    kwargs = dict(name="ampfused._C", include_dirs=[CSRC], extra_compile_args={"cxx": cxx}, extra_link_args=openmp_link)
    if cuda_home is not None:
        cpp_extension.CUDA_HOME = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            if torch.cuda.is_available():
                say("TORCH_CUDA_ARCH_LIST unset: building for the visible GPUs")
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
                say(f"TORCH_CUDA_ARCH_LIST unset and no GPU visible: building for {DEFAULT_ARCH_LIST}")
        cxx.append("-DAMPFUSED_WITH_CUDA")
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-DAMPFUSED_WITH_CUDA", "-Xfatbin=-compress-all"]
        extension = cpp_extension.CUDAExtension(sources=sources + [_source(s) for s in CUDA_SOURCES], **kwargs)
        say(f"building ampfused._C with CPU and CUDA kernels (arch list {os.environ['TORCH_CUDA_ARCH_LIST']})")
    else:
        extension = cpp_extension.CppExtension(sources=sources, **kwargs)
        say(f"building ampfused._C with CPU kernels only (no CUDA kernels: {why_not})")
    ninja = cpp_extension.is_ninja_available()
    if not ninja:
        say("ninja not found: compiling one file at a time (`pip install ninja` for parallel builds; MAX_JOBS sets the jobs)")
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=ninja)
    return {"ext_modules": [extension], "cmdclass": {"build_ext": build_ext}}


def testing_load_kwargs(torch) -> dict:
    """Arguments of ``torch.utils.cpp_extension.load`` for the test-only extension (csrc/testing/):
    CPU only, compiled and linked as ``_C``'s CPU files are, so a test of its OpenMP threads or its
    per-ISA arithmetic speaks for ``_C``. Its ops register as ``torch.ops.ampfused_testing.*``."""
    openmp_cxx, openmp_link = openmp_flags(torch)
    return dict(
        name="ampfused_testing",
        sources=[os.path.join(CSRC, s) for s in TESTING_SOURCES],
        extra_cflags=CXX_FLAGS + openmp_cxx,
        extra_ldflags=openmp_link,
        extra_include_paths=[CSRC],
        is_python_module=False,
    )
