"""Build script for ampfused.

The Python package always installs. The compiled extension ``ampfused._C`` is added by
``csrc/build_extension.py`` when torch is importable at build time (``pip install --no-build-isolation .``).
"""
import importlib.util
import os

from setuptools import find_packages, setup

# ampfused/ is the library, with ampfused/bench (the main job, `python -m ampfused bench`); the Triton
# kernels live in the top-level kernels/ (DESIGN §5) and install as ampfused.kernels. benchmarks/
# holds studies and GPU scripts that run from a checkout and are not installed.
PACKAGES = find_packages(include=["ampfused", "ampfused.*"]) + ["ampfused.kernels"]
PACKAGE_DIR = {"ampfused.kernels": "kernels"}


def extension_kwargs():
    """ext_modules/cmdclass for ampfused._C, or {} with a message saying why it is skipped."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "build_extension.py")
    if not os.path.exists(path):
        return {}
    spec = importlib.util.spec_from_file_location("ampfused_build_extension", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.extension_kwargs()


setup(packages=PACKAGES, package_dir=PACKAGE_DIR, **extension_kwargs())
