"""Building mci's CPU kernels: the C sources compiled once per machine with the system's C
compiler into a cache folder (`$XDG_CACHE_HOME/mci/kernels`, keyed by the sources' and flags'
hash), and what this CPU supports. The bindings that load the result are cpu_kernels.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_matvec.c",
        "cpu_fp8.c",
        "cpu_mla.c",
        "cpu_moe.c",
        "cpu_amx.c",
        "cpu_prefill_attention.c",
    )
]
HEADER = Path(__file__).with_name("cpu_kernels.h")
# -ffp-contract=off: where the C code writes a product and then a sum (rope, the experts'
# weighted sum), they stay two roundings, as in the torch code they stand in for (explicit
# fused multiply-add intrinsics elsewhere are unaffected).
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw",
         "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16"]  # fmt: skip


def cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_supports() -> bool:
    """The CPU runs the kernels' instructions (AVX512-BF16; AMX and VBMI are checked apart)."""
    flags = cpu_flags()
    return " avx512_bf16" in flags and " avx512bw" in flags


def cpu_supports_fp8() -> bool:
    """The CPU runs the FP8 kernels' byte lookups (AVX512-VBMI's vpermi2b; cpu_fp8.c)."""
    return " avx512vbmi" in cpu_flags()


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(out), *map(str, SOURCES)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        out.replace(target)  # atomic: concurrent builders each install a complete file


def built_library() -> Path:
    """The compiled library for the current sources, built first if this machine has none
    (RuntimeError, OSError or a subprocess error when it cannot be)."""
    code = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    digest = hashlib.sha256(code + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache / "mci" / "kernels" / f"cpu_kernels-{digest}.so"
    if not target.exists():
        _build(target)
    return target
