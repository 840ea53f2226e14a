"""llama.cpp reads our test GGUFs as we do: its greedy tokens against HF transformers'.

For each architecture, a tiny random HF model (tests/hf_gguf.py, which our model is tested
against) is written as GGUF the way llama.cpp's converter writes it; llama-server (a CPU build
is enough: `bench/peers/build_llama_server.sh SRC BUILD cpu`) runs it greedily from a fixed
prompt, and its tokens are compared with HF's. Where they part, the HF logit gap between the two
candidates at that position is reported: a gap near zero is a near-tie that float order can
flip, not a different model. Files from bench/make_model.py are also loaded and run, to show
llama-server accepts them.

    python bench/peers/greedy_vs_llama.py --llama-server /tmp/llb/bin/llama-server \\
        --archs qwen35 qwen35moe --out bench/results/greedy_llama_cpp_cpu.json
"""

from __future__ import annotations

import argparse
import logging
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from meta import meta_line, run_meta, write_result  # noqa: E402

PROMPT = [5, 77, 300, 12, 9, 140, 33, 250, 61, 2, 99, 7, 18]
log = logging.getLogger("greedy_vs_llama")


def serve(binary: str, path: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [binary, "-m", path, "--port", str(port), "-c", "512", "-np", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(240):
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} on {path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"llama-server not healthy on {path}")


def greedy(port: int, ids: list[int], n: int) -> list[int]:
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "samplers": ["top_k"], "top_k": 1,
            "return_tokens": True, "cache_prompt": False}  # fmt: skip
    return httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=300).json()[
        "tokens"
    ]


def compare(binary: str, arch: str, n: int, tmp: str) -> dict:
    import torch

    from hf_gguf import hf_to_gguf, make_hf_model

    model = make_hf_model(arch, seed=2)
    path = str(hf_to_gguf(model, arch, Path(tmp) / f"{arch}.gguf"))
    seq, gaps = list(PROMPT), []
    with torch.no_grad():
        for _ in range(n):
            top = torch.topk(model(torch.tensor([seq])).logits[0, -1], 2)
            gaps.append((int(top.indices[1]), float(top.values[0] - top.values[1])))
            seq.append(int(top.indices[0]))
    hf = seq[len(PROMPT) :]
    proc, port = serve(binary, path)
    try:
        ll = greedy(port, PROMPT, n)
    finally:
        proc.terminate()
    first = next((i for i, (a, b) in enumerate(zip(hf, ll, strict=True)) if a != b), None)
    row = {"arch": arch, "hf": hf, "llama": ll, "equal_prefix": n if first is None else first}
    if first is not None:
        row["hf_runner_up"], row["hf_gap"] = gaps[first]
    return row


def make_model_file(binary: str, shape_name: str, shape: dict, vocab: str, tmp: str) -> dict:
    import make_model

    make_model.SHAPES[shape_name] = shape
    path = str(Path(tmp) / f"{shape_name}.gguf")
    make_model.write(shape_name, "q4_k_m", vocab, path)
    proc, port = serve(binary, path)
    try:
        return {"file": f"make_model {shape_name} q4_k_m", "tokens": greedy(port, [100, 200], 8)}
    finally:
        proc.terminate()


TINY = {
    "qwen35-tiny": dict(d=256, L=4, H=2, K=1, D=128, F=256, tied=False, Hk=2, Hv=4),
    "qwen35moe-tiny": dict(
        d=256, L=4, H=2, K=1, D=128, F=256, tied=False, Hk=2, Hv=4, E=4, k=2, Fe=256, Fs=256
    ),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--archs", nargs="+", default=["qwen35", "qwen35moe"])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--vocab", default=str(ROOT.parent / "shared/fixtures/tokenizers/ggml-vocab-qwen2.gguf")
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [compare(a.llama_server, arch, a.tokens, tmp) for arch in a.archs]
        files = [make_model_file(a.llama_server, k, v, a.vocab, tmp) for k, v in TINY.items()]
    lines = [
        "Greedy tokens of llama-server (llama.cpp 11434, CPU build) against HF transformers on "
        "the same tiny random GGUF (tests/hf_gguf.py)",
        "",
        "| arch | tokens equal | first difference: HF logit gap to llama.cpp's token |",
        "| --- | --- | --- |",
    ]
    for r in rows:
        gap = "none"
        if "hf_gap" in r:
            got = r["llama"][r["equal_prefix"]]
            gap = f"{r['hf_gap']:.2e} (HF's runner-up {r['hf_runner_up']}, llama.cpp's {got})"
        lines.append(f"| {r['arch']} | {r['equal_prefix']} of {a.tokens} | {gap} |")
    lines += ["", "bench/make_model.py files llama-server loads and runs:", ""]
    lines += [f"- {f['file']}: {f['tokens']}" for f in files]
    meta = run_meta()
    res = {"bench": "greedy_vs_llama", **meta, "rows": rows, "make_model": files}
    write_result(res, "\n".join(lines) + "\n\n" + meta_line(meta) + "\n", a.out)


if __name__ == "__main__":
    main()
