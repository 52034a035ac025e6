"""Native CPU kernels: C sources in csrc/, compiled on first use for this machine, called by ctypes.

    csrc/decode_attention.c   one query per request; requests on a shared run read it once
    csrc/extend_attention.c   prefill: new tokens attend causally to their prefix and themselves
    csrc/flash_tile.h         the register-tiled flash attention loops both use
    csrc/rope_store.c         rope on q and k, and the K/V write into the pool, in one call
    csrc/rms_norm.c           the residual add + RMS norm, and silu(gate) * up, one call each
    csrc/skinny_linear.c      linear layers on a packed weight: decode batches stream it, larger
                              ones go through register tiles
    csrc/decode_step.c        a decode step through all the decoder layers, calling the above

Both read K/V where they lie in the pool (float32 or bfloat16), with no gather. Why C and not a
PyTorch extension: a few small files compile in seconds with the system C compiler and
need neither PyTorch's headers nor ninja. Why compile here and not ship a binary:
`-march=native` picks this CPU's vector units (AVX2 or AVX-512), which the hot loops depend on.

The library lands in a cache directory (`$RADIXLM_CACHE_DIR`, else `~/.cache/radixlm`) under a
name that hashes the sources, the flags and the CPU, so a changed kernel or a different machine
gets its own build; it is written to a temporary name and renamed, so concurrent builds are
safe. Without a C compiler, or with `RADIXLM_NATIVE=0`, `kernels()` returns None and callers
use their PyTorch path: the kernels make things faster, never possible.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm import hugepages

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "decode_attention.c",
        "extend_attention.c",
        "rope_store.c",
        "rms_norm.c",
        "skinny_linear.c",
        "decode_step.c",
    )
]
HEADERS = [Path(__file__).parent / "csrc" / h for h in ("flash_tile.h", "bf16.h")]  # included
KV_DTYPES = (torch.float32, torch.bfloat16)  # pool dtypes the kernels read
MAX_HEAD_DIM = 256  # head_dim: a multiple of 16 (whole vector registers), at most this
SKINNY_MAX_ROWS = 16  # skinny_linear streams W for up to this many rows; more go through tiles
FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]  # and -march


def enabled() -> bool:
    """False when RADIXLM_NATIVE=0 asks for the PyTorch paths only."""
    return os.environ.get("RADIXLM_NATIVE", "1") != "0"


@functools.cache
def kernels() -> Kernels | None:
    """The kernels for this CPU, built on first use; None where they cannot be built."""
    return build_kernels("native") if enabled() else None


def build_kernels(march: str) -> Kernels | None:
    """The kernels compiled with `-march={march}` ("native": this CPU; tests also build
    "haswell", AVX2 without AVX-512, to check the narrower vector code); None on failure."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: native kernels off, PyTorch attention used")
        return None
    try:
        path = _build(compiler, [*FLAGS, f"-march={march}"])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("native kernels failed to build (%s): PyTorch attention used", exc)
        return None
    return Kernels(ctypes.CDLL(str(path)))


class Kernels:
    """The compiled library. Arithmetic is float32 whatever the storage (but see `extend` for
    bfloat16 models): queries are widened and outputs narrowed to the queries' dtype."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        # q k v out, H KV D, K/V slot and head strides, bf16, scale, count of units or spans
        common: list[Any] = [p, p, p, p, i64, i64, i64, i64, i64, i32, f32, i64]
        self._decode = lib.decode_attention
        self._decode.argtypes = [*common, p, p, p, p, p, i32]
        self._extend = lib.extend_attention
        self._extend.argtypes = [*common, p, p, i32]
        self._rope_store = lib.rope_store
        self._rope_store.argtypes = [
            p, i64, i64, i64, i64, i64, i64, i64, p, p, p, p, p, i32, i32, p, i32
        ]  # fmt: skip
        self._add_rms_norm = lib.add_rms_norm
        self._add_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32, i32]
        self._silu_mul = lib.silu_mul
        self._silu_mul.argtypes = [p, p, i64, i64, i32, i32]
        self._skinny = lib.skinny_linear
        self._skinny.argtypes = [p, p, p, i64, i64, i64, i32, i32]
        self._decode_layers = lib.decode_layers
        model: list[Any] = [p, p, p, p, i64, i64, p, i64, i64, i64, i64, i64, i64, i64, f32, i32]
        model += [i32, f32]
        step: list[Any] = [p, p, p, i64, p, p, p, p, p, i32]  # rope, out_slots, layout, threads
        self._decode_layers.argtypes = [*model, *step]
        for fn in (
            self._decode,
            self._extend,
            self._rope_store,
            self._add_rms_norm,
            self._silu_mul,
            self._skinny,
            self._decode_layers,
        ):
            fn.restype = ctypes.c_int
        # True when the kernels do bfloat16 dot products (AVX512-BF16) for bfloat16 models
        self.bf16_dots = bool(lib.extend_bf16_dots())

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: DecodeLayout
    ) -> torch.Tensor:
        """q (B, H, D), one query per request (the members of `layout`, in order); k/v_cache
        (num_slots, KV, D) -> (B, H, D). Shared runs of bfloat16 queries over a bfloat16 pool
        use bfloat16 dot products as `extend` does."""
        return _attend(self._decode, q, k_cache, v_cache, layout.num_units, layout.pointers)

    def extend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: ExtendLayout
    ) -> torch.Tensor:
        """q (T, H, D): the new tokens of the requests in `layout`, back to back; k/v_cache
        (num_slots, KV, D), already holding the new tokens' K/V -> (T, H, D). Rows of q that
        belong to no span of the layout come back uninitialised.

        bfloat16 queries over a bfloat16 pool use bfloat16 dot products where the CPU has them
        (`bf16_dots`): the probabilities are rounded to bfloat16 before P V."""
        return _attend(self._extend, q, k_cache, v_cache, layout.num_spans, layout.pointers)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h += delta (in place; none when delta is None), then return the RMS norm of h times
        weight. h, delta (T, hidden) and weight (hidden,): contiguous, one dtype (float32 or
        bfloat16); float32 arithmetic, a bfloat16 h rounded after the add."""
        tensors = [h, weight] if delta is None else [h, delta, weight]
        if any(t.dtype != h.dtype or not t.is_contiguous() for t in tensors):
            raise ValueError("add_rms_norm takes contiguous tensors of one dtype")
        if h.dtype not in KV_DTYPES or h.device.type != "cpu":
            raise ValueError(f"add_rms_norm runs on float32 or bfloat16 CPU tensors: {h.dtype}")
        if (
            h.dim() != 2
            or h.shape[1] != weight.shape[0]
            or (delta is not None and delta.shape != h.shape)
        ):
            raise ValueError(f"shapes: h {tuple(h.shape)}, weight {tuple(weight.shape)}")
        out = torch.empty_like(h)
        status = self._add_rms_norm(
            h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
            out.data_ptr(), h.shape[0], h.shape[1], eps, int(h.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"add_rms_norm failed ({status})")
        return out

    def skinny_linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x (M, K) @ W^T, W packed by `pack_skinny` -> (M, N) in x's dtype (float32
        accumulation): up to SKINNY_MAX_ROWS rows stream W, more go through register tiles."""
        num_rows, k = x.shape
        n = packed.shape[0] * 16
        if x.dtype != packed.dtype or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("skinny_linear takes contiguous CPU rows of the packed weight's dtype")
        if num_rows < 1 or packed.numel() != n * k:
            raise ValueError(f"skinny_linear: x {tuple(x.shape)} against a packed ({n}, ?) weight")
        y = x.new_empty(num_rows, n)
        status = self._skinny(
            x.data_ptr(), packed.data_ptr(), y.data_ptr(), num_rows, n, k,
            int(x.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"skinny_linear failed ({status})")
        return y

    def decode_layers(
        self,
        h: torch.Tensor,
        weights: torch.Tensor,
        kv: torch.Tensor,
        kv_strides: tuple[int, int],
        final_norm: torch.Tensor,
        shape: DecoderShape,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        kv_dtype: torch.dtype,
        layout: DecodeLayout,
    ) -> torch.Tensor:
        """A decode step through every decoder layer (csrc/decode_step.c): h (B, hidden), the
        embeddings, becomes the residual stream after the last layer (in place); returns the
        final norm of it. `weights` (num_layers, 6) int64 holds each layer's weight addresses
        (input norm, packed Wqkv, packed Wo, post-attention norm, packed Wgate_up, packed
        Wdown), `kv` (num_layers, 2) its K and V pool views' (KVPool.layer_addresses), whose
        slot and head strides (elements) are `kv_strides` (KVPool.kv_strides); rope as
        rope_store takes it; one token per request of `layout`."""
        num_rows = h.shape[0]
        if h.dtype not in KV_DTYPES or not h.is_contiguous() or kv_dtype not in KV_DTYPES:
            raise ValueError("decode_layers runs float32 or bfloat16 models and pools")
        tables = (weights.shape, kv.shape) == ((shape.num_layers, 6), (shape.num_layers, 2))
        if num_rows < 1 or not tables or {weights.dtype, kv.dtype} != {torch.int64}:
            raise ValueError(f"decode_layers: {num_rows} rows, tables {weights.shape} {kv.shape}")
        if layout.member_row.numel() != num_rows:
            raise ValueError("decode_layers: the layout's requests are not h's rows")
        d, slot, head = shape.head_dim, *kv_strides
        if (slot, head) != (shape.num_kv_heads * d, d) and (slot != d or head % d or head <= d):
            raise ValueError(
                f"decode_layers: K/V strides {kv_strides}, neither slot- nor head-major"
            )
        cos, sin = (t.contiguous() for t in rope)
        slots = out_slots.to(torch.int64).contiguous()
        bf16 = h.dtype == torch.bfloat16
        kv_mode = int(kv_dtype == torch.bfloat16) * (2 if bf16 else 1)
        x = torch.empty_like(h)
        status = self._decode_layers(
            h.data_ptr(), x.data_ptr(), weights.data_ptr(), kv.data_ptr(), *kv_strides,
            final_norm.data_ptr(),
            shape.num_layers, num_rows, shape.hidden, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, shape.intermediate, shape.eps, int(bf16), kv_mode,
            shape.head_dim**-0.5, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            layout.num_units, *layout.pointers, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_layers failed ({status})")
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up (T, 2 I), gate first -> (T, I), in gate_up's dtype
        (float32 or bfloat16; float32 arithmetic)."""
        if gate_up.dtype not in KV_DTYPES or gate_up.device.type != "cpu":
            raise ValueError(f"silu_mul runs on float32 or bfloat16 CPU tensors: {gate_up.dtype}")
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
            raise ValueError(f"silu_mul takes contiguous (T, 2 I) rows: {tuple(gate_up.shape)}")
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        act = gate_up.new_empty(num_tokens, inter)
        status = self._silu_mul(
            gate_up.data_ptr(), act.data_ptr(), num_tokens, inter,
            int(gate_up.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"silu_mul failed ({status})")
        return act

    def rope_store(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """Rotate the new tokens' q and k and write k, v into the pool at `out_slots`.

        qkv (T, (H + 2 KV) * D) float32 or bfloat16, the stacked projection; rope: (cos,
        sign-folded sin), each (T, 1, D) float32 (rope.rope_cos_sin). Arithmetic is float32.
        Returns q (T, H, D) in qkv's dtype, rotated."""
        cos, sin = rope
        num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[1:]
        if qkv.dtype not in KV_DTYPES or cos.dtype != torch.float32 or qkv.stride(1) != 1:
            raise ValueError("rope_store takes float32 or bfloat16 rows of the qkv projection")
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv rows of {qkv.shape[1]} do not hold {num_heads} query heads")
        if k_cache.dtype not in KV_DTYPES:
            raise ValueError("the native kernels read float32 or bfloat16 K/V")
        strides = kv_strides(k_cache, v_cache)
        q = qkv.new_empty(num_tokens, num_heads, head_dim)
        slots = out_slots.to(torch.int64).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        kv_bf16, qkv_bf16 = int(k_cache.dtype == torch.bfloat16), int(qkv.dtype == torch.bfloat16)
        status = self._rope_store(
            qkv.data_ptr(), num_tokens, qkv.stride(0), num_heads, num_kv_heads, head_dim,
            *strides, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), kv_bf16, qkv_bf16, q.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"rope_store failed ({status})")
        return q


@dataclass(frozen=True)
class DecoderShape:
    """What decode_layers needs to know of the model besides its weights."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class ExtendLayout:
    """Requests with new tokens for the extend kernel: per span, its first row among the T new
    tokens, extend_len, prefix_len, and where its prefix_len + extend_len slots start in `slots`.
    """

    def __init__(self, spans: list[tuple[int, int, int, torch.Tensor]]):
        """spans: (first row, extend_len, prefix_len, all of the request's slots)."""
        rows, offset = [], 0
        for first, extend_len, prefix_len, slots in spans:
            rows.append((first, extend_len, prefix_len, offset))
            offset += len(slots)
        self.num_spans = len(spans)
        self.spans = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
        self.slots = torch.cat([s for *_, s in spans]).to(torch.int64).cpu()
        self.pointers = (self.spans.data_ptr(), self.slots.data_ptr())  # alive with the tensors


def can_pack_skinny(weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes this (out, in) weight: float32 or bfloat16 on the CPU, out a
    multiple of 16, in even."""
    n, k = weight.shape
    return weight.dtype in KV_DTYPES and weight.device.type == "cpu" and not n % 16 and not k % 2


def pack_skinny(weight: torch.Tensor, arena: hugepages.Arena | None = None) -> torch.Tensor | None:
    """A dense (out, in) weight in skinny_linear's layout: blocks of 16 output columns, k-major
    inside (float32 (out/16, in, 16); bfloat16 (out/16, in/2, 16, 2)), in a tensor of its own
    or taken from `arena`. None where the kernel does not apply (see can_pack_skinny)."""
    if not can_pack_skinny(weight):
        return None
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.float32:
        packed = w.reshape(n // 16, 16, k).transpose(1, 2)
    else:
        packed = w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    if arena is None:
        return packed.contiguous()
    return arena.take(tuple(packed.shape), packed.dtype).copy_(packed)


def kv_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(slot, head) strides in elements of a pool layer's K and V views (num_slots, kv, D): the
    kernels take any layout whose head rows are contiguous and disjoint, as long as K and V
    share it (KVPool's CPU pools are head-major, (kv, num_slots, D) underneath)."""
    num_slots, num_kv_heads, head_dim = k_cache.shape
    strides = k_cache.stride()
    if v_cache.shape != k_cache.shape or v_cache.stride() != strides or strides[2] != 1:
        raise ValueError(f"K/V pool views of strides {strides} and {v_cache.stride()}")
    slot, head = strides[0], strides[1]
    if (slot, head) not in ((num_kv_heads * head_dim, head_dim), (head_dim, num_slots * head_dim)):
        raise ValueError(f"K/V pool views must be slot- or head-major: strides {strides}")
    return slot, head


def _attend(
    fn: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    count: int,
    pointers: tuple[int, ...],
) -> torch.Tensor:
    """Call an attention kernel (decode or extend: same leading arguments) -> out in q's dtype.
    kv_mode: 0 float32 K/V, 1 bfloat16 K/V, 2 bfloat16 K/V and queries (a bfloat16 model: the
    kernels may use bfloat16 dot products)."""
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the native kernels read float32 or bfloat16 K/V: {k_cache.dtype}")
    strides = kv_strides(k_cache, v_cache)
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        raise ValueError("the native kernels run on CPU tensors")
    num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    if head_dim % 16 != 0 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}: {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    q32 = q.to(torch.float32).contiguous()
    out = torch.empty_like(q32)
    kv_mode = int(k_cache.dtype == torch.bfloat16) * (2 if q.dtype == torch.bfloat16 else 1)
    tensors = (q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
    shape = (num_heads, num_kv_heads, head_dim, *strides, kv_mode, head_dim**-0.5, count)
    status = fn(*tensors, *shape, *pointers, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"{fn.__name__} failed ({status})")
    return out.to(q.dtype)


def _build(compiler: str, flags: list[str]) -> Path:
    """The library for these sources, flags and CPU: from the cache, or compiled into it (the
    user's cache directory, else a per-user one under the temp directory)."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    for part in (compiler, " ".join(flags), platform.machine(), _cpu_flags()):
        key.update(part.encode())
    name = f"radixlm_kernels-{key.hexdigest()[:16]}.so"
    home = Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")
    fallback = Path(tempfile.gettempdir()) / f"radixlm-{os.getuid()}"
    for cache in (home, fallback):
        if (cache / name).exists():
            return cache / name
    try:
        return _compile(compiler, flags, home / name)
    except PermissionError:
        return _compile(compiler, flags, fallback / name)


def _compile(compiler: str, flags: list[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling native kernels into %s", path)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        cmd = [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        built.replace(path)  # atomic: a concurrent build of the same key writes the same bytes
    return path


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), else its name: part of the build's cache key."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    flags = [line for line in text.splitlines() if line.startswith("flags")]
    return flags[0] if flags else platform.processor()


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
