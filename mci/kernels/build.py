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

COMMON = (
    "cpu_matvec.c",
    "cpu_mla.c",
    "cpu_moe.c",
    "cpu_decoder.c",
    "cpu_prefill_attention.c",
)
# The kernels' two builds: AVX-512 (with BF16 dot products, AMX and VBMI's FP8), and AVX2 + FMA,
# where cpu_avx2.h writes each 512-bit operation of the common kernels as two 256-bit halves
# and the AVX-512-only entry points are stubs (cpu_avx512_only.c).
SOURCES = {
    "avx512": [
        Path(__file__).with_name(n) for n in (*COMMON, "cpu_fp8.c", "cpu_gemm.c", "cpu_amx.c")
    ],
    "avx2": [Path(__file__).with_name(n) for n in (*COMMON, "cpu_avx512_only.c")],
}
HEADERS = [Path(__file__).with_name(n) for n in ("cpu_kernels.h", "cpu_avx2.h")]
# -ffp-contract=off: where the C code writes a product and then a sum (rope, the experts'
# weighted sum), they stay two roundings, as in the torch code they stand in for (explicit
# fused multiply-add intrinsics elsewhere are unaffected). -Wno-psabi: the AVX2 build passes
# 512-bit vectors between inlined helpers, which GCC warns would change a public ABI.
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
FLAGS = {
    "avx512": [*BASE_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma",
               "-mamx-tile", "-mamx-bf16"],
    "avx2": [*BASE_FLAGS, "-mavx2", "-mfma", "-Wno-psabi"],
}  # fmt: skip


def tuned_flags(isa: str) -> list[str]:
    """`isa`'s flags, with the defines tuned per CPU vendor (each measured on one: cpu_matvec.c's
    STREAM_AHEAD, the weight bytes its address-ordered passes prefetch: 4 KB on Intel, none
    on AMD; one CPU of each measured, so the vendor stands for its CPUs)."""
    if isa == "avx512" and "GenuineIntel" in cpu_flags():
        return [*FLAGS[isa], "-DSTREAM_AHEAD=4096"]
    return list(FLAGS[isa])


def cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_supports() -> bool:
    """The CPU runs the AVX-512 build's instructions (AVX512-BF16; AMX and VBMI are checked
    apart)."""
    flags = cpu_flags()
    return " avx512_bf16" in flags and " avx512bw" in flags


def cpu_isa() -> str | None:
    """Which build of the kernels this CPU runs: "avx512", "avx2" (AVX2 and FMA), or None."""
    if cpu_supports():
        return "avx512"
    flags = cpu_flags()
    return "avx2" if " avx2" in flags and " fma" in flags else None


def cpu_supports_fp8() -> bool:
    """The CPU runs the FP8 kernels' byte lookups (AVX512-VBMI's vpermi2b; cpu_fp8.c)."""
    return " avx512vbmi" in cpu_flags()


def _build(target: Path, isa: str, flags: list[str]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(out), *map(str, SOURCES[isa])],
            check=True,
            capture_output=True,
            timeout=120,
        )
        out.replace(target)  # atomic: concurrent builders each install a complete file


def built_library(isa: str = "avx512", tuned: bool = True) -> Path:
    """The compiled library of `isa`'s build for the current sources, built first if this
    machine has none (RuntimeError, OSError or a subprocess error when it cannot be); with
    `tuned` False, without this CPU vendor's tuning (the tests compare the two)."""
    code = b"".join(path.read_bytes() for path in (*SOURCES[isa], *HEADERS))
    flags = tuned_flags(isa) if tuned else FLAGS[isa]
    digest = hashlib.sha256(code + " ".join(flags).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache / "mci" / "kernels" / f"cpu_kernels-{isa}-{digest}.so"
    if not target.exists():
        _build(target, isa, flags)
    return target
