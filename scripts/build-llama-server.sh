#!/usr/bin/env bash
# llama.cpp's native server, for benchmarks/llamacpp_server.py --servers llama-server,llama-server-avx2 (issues 17
# and 31): built from the llama.cpp source that llama-cpp-python 0.3.36 vendors (the same ggml as the Python
# server's build), outside the repository; never a statekeeper dependency. Two builds, reported side by side:
#   native  GGML_NATIVE=ON: compiled for this CPU (its AVX-512 paths where it has them), what a user who
#           builds llama.cpp gets; the honest anchor (issue 31).
#   avx2    GGML_NATIVE=OFF with AVX2/FMA/F16C only: the build issue 17's comparisons used.
#   avx512  GGML_NATIVE=OFF with AVX-512 (F, VBMI, VNNI, BF16) and AVX-VNNI but no AMX: on an Intel Xeon whose
#           native build dies of SIGILL in ggml's AMX kernel (tilezero; BENCHMARKS.md, 2026-11-27), the native
#           build's ISA less AMX, so that its weight repacking can stay on.
#   bash scripts/build-llama-server.sh [native|avx2|avx512] [build dir, default /work/llamabench/server-<flavour>]
set -euo pipefail
flavour="${1:-native}"
case "$flavour" in
    native) flags=(-DGGML_NATIVE=ON) ;;
    avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON) ;;
    avx512) flags=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON
                   -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
    *) echo "usage: $0 [native|avx2|avx512] [build dir]" >&2; exit 2 ;;
esac
build_dir="${2:-/work/llamabench/server-$flavour}"
source_dir="$(dirname "$build_dir")/llama-cpp-python-src"
if [ ! -d "$source_dir/llama_cpp_python-0.3.36" ]; then
    mkdir -p "$source_dir"
    pip download --quiet --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$source_dir"
    tar xzf "$source_dir/llama_cpp_python-0.3.36.tar.gz" -C "$source_dir"
fi
cmake -S "$source_dir/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "${flags[@]}" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build "$build_dir" --target llama-server
echo "$build_dir/bin/llama-server"
