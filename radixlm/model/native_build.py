"""Builds the native kernels (csrc/) once per instruction set, and picks the one this CPU runs.

    variant   compiler flags                          needs (Linux /proc/cpuinfo flags)
    avx512    -march=x86-64-v4, + -mavx512bf16 where   avx512f/bw/vl/dq/cd (+ avx512_bf16)
              the CPU has AVX512-BF16
    avx2      -march=x86-64-v3 (AVX2 + FMA)            avx2 fma bmi1 bmi2 f16c movbe
    generic   the compiler's baseline (SSE2, NEON)     nothing

The sources size their vectors and register tiles per variant (csrc/simd.h). The first variant
of that list the CPU can execute runs, unless `RADIXLM_ISA` names one (refused, with the reason,
if the CPU cannot execute it); `RADIXLM_NATIVE=0` turns the kernels off (native.py).

Builds happen at install (`python -m radixlm.model.native_build`, which `make` runs): every
variant this CPU can execute, each source its own object, compiled in parallel. A library found
missing at run time is built then (logged as a warning: it should have been built at install).
Libraries land in `$RADIXLM_CACHE_DIR`, else `~/.cache/radixlm`, under a name that hashes the
sources, the compiler and the flags; they are written under a temporary name and renamed, and a
lock file makes a second process wait for the first one's build instead of repeating it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "decode_attention.c",
        "decode_attention_bf16.c",
        "decode_attention_dots.c",
        "decode_attention_i8.c",
        "extend_attention.c",
        "rope_store.c",
        "rms_norm.c",
        "skinny_linear.c",
        "decode_step.c",
        "quant_linear.c",
        "quant_repack.c",
    )
]
# included by the sources
HEADERS = [
    CSRC / h for h in ("simd.h", "flash_tile.h", "decode_task.h", "bf16.h", "quant_record.h")
]
COMMON_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
# The link drops -ffast-math: with it, gcc links crtfastmath.o, whose constructor sets
# flush-to-zero and denormals-are-zero in the MXCSR of the thread that loads the library (and of
# every thread started after), changing float arithmetic outside the kernels (PyTorch, the
# sampler) the moment the library loads.
LINK_FLAGS = ("-fopenmp", "-shared")
# Decode attention keeps each query row's arithmetic independent of the rows it shares a chunk
# with, so a lone request's query heads may go to different threads and keep their bits:
# reassociation regroups a row's sums differently as the number of rows in a chunk changes.
SOURCE_FLAGS = {
    name: ("-fno-associative-math",)
    for name in (
        "decode_attention.c",
        "decode_attention_bf16.c",
        "decode_attention_dots.c",
        "decode_attention_i8.c",
    )
}
X86 = platform.machine() in ("x86_64", "AMD64")


class BuildError(RuntimeError):
    """A variant did not compile; the message names it and quotes the compiler."""


@dataclass(frozen=True)
class Variant:
    name: str
    march: tuple[str, ...]  # the flags that pick the instruction set
    needs: frozenset[str]  # CPU flags (as /proc/cpuinfo spells them) it executes on


AVX512 = Variant(
    "avx512",
    ("-march=x86-64-v4",),
    frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma"}),
)
AVX2 = Variant(
    "avx2", ("-march=x86-64-v3",), frozenset({"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})
)
GENERIC = Variant("generic", ("-march=x86-64",) if X86 else (), frozenset())
VARIANTS = {v.name: v for v in (AVX512, AVX2, GENERIC)}  # fastest first


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo spells them, less any vector extension the
    CPUID probe PyTorch runs at start (cpuinfo: CPUID and the registers the OS saves) denies.
    The probe has the last word because /proc/cpuinfo can describe another CPU: an emulator
    such as qemu-user passes the host's file through while executing a smaller instruction set.
    Without /proc/cpuinfo the probe alone answers."""
    probed = _probed_flags()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                return flags if probed is None else _within(flags, probed)
    return probed if probed is not None else frozenset()


def _probed_flags() -> frozenset[str] | None:
    """The vector extensions PyTorch's CPUID probe finds, spelled as /proc/cpuinfo does, or
    None where there is no probe (not x86, or a PyTorch without it)."""
    if not X86:
        return None
    import torch

    probe = getattr(torch, "cpu", None)
    try:
        has_avx512 = probe._is_avx512_supported()  # type: ignore[union-attr]
        has_avx2 = probe._is_avx2_supported()  # type: ignore[union-attr]
        has_bf16 = probe._is_avx512_bf16_supported()  # type: ignore[union-attr]
    except AttributeError:
        return None
    flags = set(AVX2.needs) if has_avx2 else set()
    if has_avx512:
        flags |= AVX512.needs
    if has_bf16:
        flags.add("avx512_bf16")
    return frozenset(flags)


def _within(flags: frozenset[str], probed: frozenset[str]) -> frozenset[str]:
    """`flags` without the AVX2 / AVX-512 families where the probe does not find them."""
    denied: set[str] = set()
    if "avx512f" not in probed:
        denied |= {f for f in flags if f.startswith("avx512")}
    if "avx512_bf16" not in probed:
        denied.add("avx512_bf16")
    if "avx512f" not in probed:
        denied.add("avx512_vnni")
    if "avx2" not in probed:
        denied |= {"avx2", "fma"}
    return flags - denied


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def missing(variant: Variant) -> list[str]:
    """The CPU flags `variant` needs that this CPU lacks (x86 variants need an x86 CPU)."""
    if variant.needs and not X86:
        return [platform.machine() + " is not x86"]
    return sorted(variant.needs - cpu_flags())


def executable_variants() -> list[Variant]:
    """The variants this CPU can execute, fastest first."""
    return [v for v in VARIANTS.values() if not missing(v)]


def chosen_variant() -> Variant:
    """`RADIXLM_ISA` if set (ValueError if unknown or not executable here), else the fastest
    variant this CPU executes."""
    name = os.environ.get("RADIXLM_ISA", "").strip().lower()
    if not name:
        return executable_variants()[0]
    if name not in VARIANTS:
        raise ValueError(f"RADIXLM_ISA={name}: not one of {', '.join(VARIANTS)}")
    lacking = missing(VARIANTS[name])
    if lacking:
        runs = ", ".join(v.name for v in executable_variants())
        raise ValueError(
            f"RADIXLM_ISA={name}: this CPU cannot execute it (it lacks {', '.join(lacking)}); "
            f"it runs {runs}"
        )
    return VARIANTS[name]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def flags(variant: Variant, cc: str) -> list[str]:
    """The compile flags of `variant`: bfloat16 and VNNI dot products in the avx512 build only
    where this CPU has them (a library is built for the CPU it is installed on) and the
    compiler knows the flag."""
    march = list(variant.march)
    if variant is AVX512 and "avx512_bf16" in cpu_flags() and _accepts(cc, "-mavx512bf16"):
        march.append("-mavx512bf16")
    if variant is AVX512 and "avx512_vnni" in cpu_flags() and _accepts(cc, "-mavx512vnni"):
        march.append("-mavx512vnni")  # vpdpbusd / vpdpwssd for the quantized matmuls
    return [*COMMON_FLAGS, *march]


def library_path(variant: Variant, cc: str) -> tuple[Path, Path]:
    """(where the library goes, where else it may already be): the cache directory, and a
    per-user one under the temp directory for a cache directory that cannot be written."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    per_source = " ".join(f"{name}:{' '.join(extra)}" for name, extra in SOURCE_FLAGS.items())
    for part in (cc, " ".join(flags(variant, cc)), " ".join(LINK_FLAGS), per_source,
                 platform.machine()):  # fmt: skip
        key.update(part.encode())
    name = f"radixlm_kernels-{variant.name}-{key.hexdigest()[:16]}.so"
    home = Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")
    return home / name, Path(tempfile.gettempdir()) / f"radixlm-{os.getuid()}" / name


def find_library(variant: Variant) -> Path | None:
    """The built library of `variant`, or None if it has not been built (or no compiler)."""
    cc = compiler()
    if cc is None:
        return None
    return next((p for p in library_path(variant, cc) if p.exists()), None)


def build(variant: Variant, jobs: int | None = None) -> Path:
    """The library of `variant`: found, or compiled now (BuildError if it does not compile;
    FileNotFoundError without a C compiler)."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC)")
    home, fallback = library_path(variant, cc)
    for path in (home, fallback):
        if path.exists():
            return path
    try:
        return _locked_compile(variant, cc, home, jobs)
    except PermissionError:
        return _locked_compile(variant, cc, fallback, jobs)


def _locked_compile(variant: Variant, cc: str, path: Path, jobs: int | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then reuse
        if not path.exists():
            _compile(variant, cc, path, jobs)
    return path


def _compile(variant: Variant, cc: str, path: Path, jobs: int | None) -> None:
    """Each source to its own object, in parallel, then one link; atomic rename into place."""
    start = time.monotonic()
    log.info("compiling the %s native kernels into %s", variant.name, path)
    flags_ = flags(variant, cc)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [Path(tmp) / (s.stem + ".o") for s in SOURCES]
        commands = [
            [cc, *flags_, *SOURCE_FLAGS.get(s.name, ()), "-c", str(s), "-o", str(o)]
            for s, o in zip(SOURCES, objects)
        ]
        workers = jobs or len(os.sched_getaffinity(0))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for cmd, done in zip(commands, pool.map(_run, commands)):
                _check(variant, cmd, done)
        built = Path(tmp) / path.name
        link = [cc, *LINK_FLAGS, *map(str, objects), "-o", str(built), "-lm"]
        _check(variant, link, _run(link))
        built.replace(path)
    log.info("built the %s kernels in %.1f s", variant.name, time.monotonic() - start)


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True)


def _check(variant: Variant, cmd: list[str], done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        raise BuildError(
            f"the {variant.name} native kernels failed to build: {' '.join(cmd)}\n"
            f"{done.stderr.strip()[-2000:]}"
        )


@functools.cache
def _accepts(cc: str, flag: str) -> bool:
    """Whether the compiler takes `flag` (compiling an empty unit)."""
    done = subprocess.run(
        [cc, flag, "-x", "c", "-c", "-", "-o", os.devnull], input="", capture_output=True
    )
    return done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """Build every variant this CPU can execute (or those named); 0 when all built, or when
    there is no compiler (the kernels are then off: a warning, not a failure)."""
    parser = argparse.ArgumentParser(prog="python -m radixlm.model.native_build")
    parser.add_argument("variants", nargs="*", help=f"of {', '.join(VARIANTS)}; default: all")
    args = parser.parse_args(argv)
    unknown = [n for n in args.variants if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if compiler() is None:
        log.warning("no C compiler: native kernels off, PyTorch paths used")
        return 0
    chosen = [VARIANTS[n] for n in args.variants] or executable_variants()
    for variant in chosen:
        start = time.monotonic()
        try:
            path = build(variant)
        except BuildError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{variant.name}: {path} ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
