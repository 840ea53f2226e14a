"""llama.cpp's token ids for every `tokenizer.ggml.pre` we support: tests/data's vectors.

Builds libllama from the llama.cpp source the benchmarks use, links
bench/peers/tokenizer_vectors.cpp against it, and tokenizes llama.cpp's qwen2 test texts plus
texts that tell the pre-tokenizers apart (numbers, scripts, cases, whitespace) with the qwen2
vocabulary, its `tokenizer.ggml.pre` set to each name in turn: the BPE merges are the same,
the split before them is the name's. Names with equal ids on every text share one group.

    python bench/peers/pre_vectors.py --src .peers/llama-cpp-11434-src.tar.xz \
        --vocab ../shared/fixtures/tokenizers/ggml-vocab-qwen2.gguf
"""

from __future__ import annotations

import argparse
import json
import logging
import struct
import subprocess
import tempfile
from pathlib import Path

from luce_jax.loading.pretokenizers import NAMES

log = logging.getLogger("pre_vectors")
ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "pre_tokenizer_vectors.json"
SEP = "\n__ggml_vocab_test__\n"
EXTRA = [
    "1,234,567 and 12345678 apples; 3.14159 or 007",
    "Ünïcödé ÀÉÎÕÜ çà et là — naïve café",
    "你好，世界！这是一个测试。日本語のテキストです。カタカナ",
    "안녕하세요 세계 ㄱㄴㄷ",
    "I'M HERE, WE'LL GO. She's, they're, I'd've",
    "CamelCaseWordsAndHTTPServer2Go getHTTPResponseCode",
    "tabs\tand\t\ttabs\r\nwindows\r\n\r\nlines",
    "path/to/file.py:42 https://example.com/a?b=c&d=e",
    "emoji 🦙🔥 and symbols ±×÷ € £ ¥ ©®™",
    "Ελληνικά Кириллица עברית العربية हिन्दी ไทย",
    "x̃ ñ ǹ combining marks e\u0301",
    "    def f(x):\n        return x ** 2  # square\n",
    "<sentinel:12> IMGIMGABZ done",
    "mixed123numbers456and789 9,999.99",
    "'quoted' \"double\" `backtick` «guillemets» „low”",
]


def retag(src: Path, dst: Path, name: str) -> None:
    """Copy a vocab-only GGUF with tokenizer.ggml.pre set to `name` (no tensors follow the
    metadata, so the string may change length)."""
    b = src.read_bytes()
    key = b"tokenizer.ggml.pre"
    i = b.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack("<I", b[i : i + 4])[0] == 8  # a string value
    n = struct.unpack("<Q", b[i + 4 : i + 12])[0]
    new = name.encode()
    dst.write_bytes(b[: i + 4] + struct.pack("<Q", len(new)) + new + b[i + 12 + n :])


def build_tool(src_tar: Path, work: Path) -> Path:
    subprocess.run(["tar", "xJf", str(src_tar), "-C", str(work)], check=True)
    ll = work / "llama.cpp"
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
                    "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"], cwd=ll, check=True)  # fmt: skip
    subprocess.run(["cmake", "--build", "build", "--target", "llama", "-j4"], cwd=ll, check=True)
    tool = work / "tokenizer_vectors"
    libs = ["build/src/libllama.a", "build/ggml/src/libggml.a", "build/ggml/src/libggml-cpu.a",
            "build/ggml/src/libggml-base.a"]  # fmt: skip
    subprocess.run(["g++", "-O2", "-std=c++17", str(ROOT / "bench/peers/tokenizer_vectors.cpp"),
                    "-Iinclude", "-Iggml/include", *libs, "-fopenmp", "-lpthread", "-ldl", "-o",
                    str(tool)], cwd=ll, check=True)  # fmt: skip
    return tool


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--src", type=Path, help="llama.cpp source tarball (unless --tool)")
    ap.add_argument("--vocab", type=Path, required=True, help="ggml-vocab-qwen2.gguf")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--tool", type=Path, help="a tokenizer_vectors binary built before")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    base = a.vocab.with_suffix(".gguf.inp").read_text("utf-8").split(SEP)[:-1]
    texts = base + EXTRA
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        tool = a.tool or build_tool(a.src, work)
        inp = work / "all.inp"
        inp.write_bytes("".join(t + SEP for t in texts).encode())
        groups: dict[str, list[str]] = {}
        for name in NAMES:
            retag(a.vocab, work / "v.gguf", name)
            run = [str(tool), str(work / "v.gguf"), str(inp)]
            lines = subprocess.run(run, check=True, capture_output=True, text=True).stdout
            lines = lines.split("\n")[:-1]
            assert len(lines) == len(texts), (name, len(lines))
            ids = [[int(x) for x in line.split()] for line in lines]
            groups.setdefault(json.dumps(ids), []).append(name)
    out = {
        "vocab": "tokenizers/" + a.vocab.name,
        "source": f"llama.cpp from {a.src.name}, bench/peers/tokenizer_vectors.cpp, the vocabulary "
        "with tokenizer.ggml.pre set to each name",
        "texts": texts,
        "groups": [{"names": sorted(ns), "ids": json.loads(k)}
                   for k, ns in sorted(groups.items(), key=lambda kv: sorted(kv[1])[0])],
    }  # fmt: skip
    a.out.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")), "utf-8")
    log.info("%d names in %d groups of equal ids -> %s", len(NAMES), len(groups), a.out)


if __name__ == "__main__":
    main()
