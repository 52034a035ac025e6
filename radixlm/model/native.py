"""Native CPU kernels: C sources in csrc/, compiled on first use for this machine, called by ctypes.

Why C and not a PyTorch extension: one small file compiles in about a second with the system C
compiler and needs neither PyTorch's headers nor ninja. Why compile here and not ship a binary:
`-march=native` picks this CPU's vector units (AVX2 or AVX-512), which the hot loops depend on.

The library lands in a cache directory (`$RADIXLM_CACHE_DIR`, else `~/.cache/radixlm`) under a
name that hashes the source, the flags and the CPU, so a changed kernel or a different machine
gets its own build; it is written to a temporary name and renamed, so concurrent builds are
safe. Without a C compiler, or with `RADIXLM_NATIVE=0`, `load()` returns None and callers use
their PyTorch path: the kernels make things faster, never possible.

OpenMP: the library is linked to libgomp.so.1. PyTorch has already loaded its own libgomp.so.1
into the process by then (it is imported first), and the dynamic loader resolves the name to that
copy, so both use one thread pool rather than fighting over the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
KV_DTYPES = (torch.float32, torch.bfloat16)  # pool dtypes the kernel reads
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]


def enabled() -> bool:
    """False when RADIXLM_NATIVE=0 asks for the PyTorch paths only."""
    return os.environ.get("RADIXLM_NATIVE", "1") != "0"


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """The decode-attention kernel, built on first use; None where it cannot be built."""
    if not enabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: native kernels off, PyTorch attention used")
        return None
    try:
        path = _build(compiler)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log.warning("native kernels failed to build (%s): PyTorch attention used", exc)
        return None
    return DecodeKernel(ctypes.CDLL(str(path)))


class DecodeKernel:
    """csrc/decode_attention.c: one query per request, K/V read in place from the pool."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.decode_attention
        self._fn.restype = ctypes.c_int
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_float, i64]
        self._fn.argtypes += [p, p, p, p, p, ctypes.c_int]

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: DecodeLayout
    ) -> torch.Tensor:
        """q (B, H, D), one query per request; k/v_cache (num_slots, KV, D) float32 or bfloat16
        -> (B, H, D) in q's dtype. The members of `layout` are q's rows, in order.

        Arithmetic is float32 whatever the storage (q and the output are widened/narrowed)."""
        if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"the decode kernel reads float32 or bfloat16 K/V: {k_cache.dtype}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the decode kernel needs contiguous K/V pool layers")
        if q.device.type != "cpu" or k_cache.device.type != "cpu":
            raise ValueError("the decode kernel runs on CPU tensors")
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[1]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
        q32 = q.to(torch.float32).contiguous()
        out = torch.empty_like(q32)
        self._fn(
            q32.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            int(k_cache.dtype == torch.bfloat16),
            head_dim**-0.5,
            layout.num_units,
            *layout.pointers,
            torch.get_num_threads(),
        )
        return out.to(q.dtype)


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source)
    for part in (compiler, " ".join(FLAGS), platform.machine(), _cpu_flags()):
        key.update(part.encode())
    cache = Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")
    path = cache / f"decode_attention-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / path.name
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        built.replace(path)  # atomic: a concurrent build of the same key writes the same bytes
    return path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


class DecodeLayout:
    """The decode batch as units for the kernel: each group of requests sharing a leading run of
    slots is one unit (the run read once for all), every other request a unit of its own.

    groups: (member indices, shared run length) as found by shared_prefix.find_shared_prefixes.
    """

    def __init__(self, slot_lists: list[torch.Tensor], groups: list[tuple[list[int], int]]):
        grouped = {i for members, _ in groups for i in members}
        units = [(members, length) for members, length in groups]
        units += [([i], 0) for i in range(len(slot_lists)) if i not in grouped]
        pieces: list[torch.Tensor] = []
        offset = 0
        unit_starts, shared, own, member_row = [0], [], [], []
        for members, length in units:
            if length:
                pieces.append(slot_lists[members[0]][:length])
            shared.append((offset, length))
            offset += length
            for i in members:
                mine = slot_lists[i][length:]
                pieces.append(mine)
                own.append((offset, len(mine)))
                offset += len(mine)
                member_row.append(i)
            unit_starts.append(len(member_row))
        self.num_units = len(units)
        self.units = torch.tensor(unit_starts, dtype=torch.int64)
        self.shared = torch.tensor(shared, dtype=torch.int64).reshape(-1, 2)
        self.own = torch.tensor(own, dtype=torch.int64).reshape(-1, 2)
        self.member_row = torch.tensor(member_row, dtype=torch.int64)
        self.slots = torch.cat(pieces).to(torch.int64).cpu()
        arrays = (self.units, self.shared, self.own, self.member_row, self.slots)
        self.pointers = tuple(a.data_ptr() for a in arrays)  # kept alive by the attributes
