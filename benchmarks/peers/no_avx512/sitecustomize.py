"""Make PyTorch's CPU feature probes report a CPU without AVX-512 (`run.py --isa avx2`).

vLLM-CPU picks its own kernel library from `torch.cpu._is_avx512_supported()` and
`_is_avx512_bf16_supported()` (vllm/platforms/cpu.py: `_C` for AVX512-BF16, `_C_AVX512`,
else `_C_AVX2`), and its attention ISA from the same probes. Those read the CPU itself and ignore
ATEN_CPU_CAPABILITY, so on an AVX-512 host only this makes vLLM take the path an AVX2-only CPU
gets. Put on PYTHONPATH, it runs at every interpreter start of the engine and its workers.
"""

import torch

for _probe in ("avx512", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_fp16"):
    if hasattr(torch.cpu, f"_is_{_probe}_supported"):
        setattr(torch.cpu, f"_is_{_probe}_supported", lambda: False)
