"""Every repository path named in the code, the docs and CI must exist.

Comments point readers at the spec, a test or a result ("tested in tests/compact/..."); when a file
moves, a stale pointer sends them nowhere. This test reads every tracked source file, README and
docs page for tokens that start with one of the repository's top-level folders and fails on any
that names no file or folder. docs/results/ is left out: each result records the command of its
run as it was then.
"""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("ampfused", "csrc", "kernels", "tests", "benchmarks", "docs", ".ci")
TEXT_SUFFIXES = (".py", ".h", ".cpp", ".cu", ".cuh", ".sh", ".md", ".toml", ".txt", ".cfg")
# A path token: a top-level folder, a slash, then path characters, not inside a longer word or path.
PATH_TOKEN = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(re.escape(t) for t in TOP_LEVEL))


def tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked file list is read from git")
    return [f for f in out.split()
            if (f.endswith(TEXT_SUFFIXES) or f.startswith(".ci/")) and not f.startswith("docs/results/")]


def test_every_named_repository_path_exists():
    missing = []
    for name in tracked_text_files():
        path = ROOT / name
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            for match in PATH_TOKEN.finditer(line):
                token = match.group(1)
                if any(c in token for c in "*<{$"):  # a pattern or a placeholder, not a path
                    continue
                if not (ROOT / token).exists():
                    missing.append(f"{name}:{number}: {token}")
    assert not missing, "paths that name nothing in this repository:\n" + "\n".join(missing)
