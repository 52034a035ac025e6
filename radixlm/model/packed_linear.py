"""Linear layers on CPU through oneDNN with weights packed once at load time.

`F.linear`'s GEMM starts from the plain (out, in) weight on every call. oneDNN can keep a
weight in its kernel's blocked layout: `pack_weight` converts a dense weight once (an opaque
MKLDNN tensor with the same logical shape and dtype) and `linear` dispatches on it. On the
model's shapes that saves the repacking work of every call, most of it at decode-sized batches
(the figures are in docs/kernels.md). Results differ from F.linear only in
summation order (fp32 accumulation).

The ops are PyTorch's own oneDNN bindings (`torch.ops.mkldnn`, the ones its CPU inference
compiler uses); when they are missing, or off CPU, weights stay dense and F.linear is used. The
same where oneDNN refuses a dtype on this CPU: bfloat16 packing needs AVX512-BW/VL/DQ or
AVX-NE-CONVERT, so on an AVX2-only CPU bfloat16 weights stay dense (the native kernels' own
packing, skinny_linear, does not depend on it).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` on `device` can be packed for oneDNN."""
    return (
        device.type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Dense (out, in) -> oneDNN blocked layout, same logical shape and dtype; the dense weight
    itself where oneDNN cannot pack its dtype on this CPU."""
    if not packs(weight.dtype):
        return weight.detach().contiguous()
    return _onednn_pack(weight.detach().contiguous())


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU (tried once on a small weight)."""
    try:
        _onednn_pack(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as exc:
        log.info("oneDNN does not pack %s weights on this CPU (%s): F.linear used", dtype, exc)
        return False
    return True


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a dense or packed weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
