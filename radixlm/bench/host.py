"""What machine a benchmark ran on, recorded in every JSON it writes.

A figure without its CPU cannot be compared: radixlm's kernels differ per instruction set and
these hosts differ from machine to machine (AVX-512 with BF16 on some, AVX2 + FMA on others).
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

# the vector extensions that decide which kernels run, in the order people read them
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")


def describe_host() -> dict[str, Any]:
    """{"cpu": model name, "cores": usable cores, "isa": [vector extensions present],
    "commit": the repository's short commit (with "+dirty" for local changes), or None}."""
    name, flags = _cpuinfo()
    return {
        "cpu": name,
        "cores": _cores(),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "commit": _commit(),
    }


def cpu_label(host: dict[str, Any] | None) -> str:
    """A table caption's CPU: "AMD EPYC, 2 cores, avx2 fma avx512f ..."."""
    if not host:
        return "CPU unrecorded"
    return f"{host['cpu']}, {host['cores']} cores, {' '.join(host['isa']) or 'no AVX'}"


def _cores() -> int | None:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _cpuinfo() -> tuple[str, set[str]]:
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.exists() else ""
    name, flags = platform.processor() or platform.machine(), set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            name = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name, flags


def _commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True,
        )  # fmt: skip
    except OSError:
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
