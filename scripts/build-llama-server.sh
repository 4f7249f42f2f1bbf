#!/usr/bin/env bash
# llama.cpp's native server, for benchmarks/llamacpp_server.py --servers llama-server (issue 17): built from the
# llama.cpp source that llama-cpp-python 0.3.36 vendors (the same ggml as the Python server's build), with the
# issue's CPU flags, outside the repository; never a statekeeper dependency.
#   bash scripts/build-llama-server.sh [build dir, default /work/llamabench/server-build]
set -euo pipefail
build_dir="${1:-/work/llamabench/server-build}"
source_dir="$(dirname "$build_dir")/llama-cpp-python-src"
if [ ! -d "$source_dir/llama_cpp_python-0.3.36" ]; then
    mkdir -p "$source_dir"
    pip download --quiet --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$source_dir"
    tar xzf "$source_dir/llama_cpp_python-0.3.36.tar.gz" -C "$source_dir"
fi
cmake -S "$source_dir/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build "$build_dir" --target llama-server
echo "$build_dir/bin/llama-server"
