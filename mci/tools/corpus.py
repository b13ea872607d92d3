"""The Python standard library as a training corpus, with a fixed held-out set.

Training reads the stdlib's `.py` sources (no tests, no bundled apps, no site-packages) except
HELD_OUT; evaluation scores the model on HELD_OUT only. Sorted paths keep it reproducible for
a given Python version.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

HELD_OUT = (
    "argparse.py",
    "difflib.py",
    "textwrap.py",
    "calendar.py",
    "shlex.py",
    "fractions.py",
    "heapq.py",
    "string.py",
    "bisect.py",
    "fnmatch.py",
    "glob.py",
    "statistics.py",
)
_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files)."""
    root = stdlib_root()
    files = sorted(
        p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts) and p.is_file()
    )
    held = [root / name for name in HELD_OUT]
    held_set = set(held)
    return [p for p in files if p not in held_set], held
