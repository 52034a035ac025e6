"""llama.cpp's own OpenAI-compatible server (llama-server) from the prebuilt xllamacpp wheel, in
that wheel's venv (install.sh xllamacpp): the same server as the llama step's build, without
compiling it.

    xllamacpp-venv/bin/python xllamacpp_server.py MODEL.gguf PORT SLOTS THREADS

SLOTS is llama-server's --parallel; the context is 2,048 tokens a slot (at least 8,192), the
prompt cache on, as engines.py's llama-server rows run. It serves until it is killed.
"""

import sys
import time

import xllamacpp


def main() -> None:
    model, port, slots, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    params = xllamacpp.CommonParams()
    params.model.path = model
    params.model_alias = {"smollm2"}
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_parallel = slots
    params.n_ctx = max(8192, 2048 * slots)
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.cache_prompt = True
    server = xllamacpp.Server(params)
    print("llama.cpp server listening on", server.listening_address, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
