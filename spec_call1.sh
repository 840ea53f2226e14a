python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LUCE_COMMIT=81f91a0 || exit
D=2026-11-30; G="$(nvidia-smi --query-gpu=name --format=csv,noheader)"
timeout 300 python3 bench/speculative.py --concurrency 1 2 5 8 --waves 2 --max-tokens 128 \
  --compile-cache-dir /tmp/xc --title "speculative decoding, embedded target + draft, $G" \
  --out $OUT/${D}_speculative_embedded_h200.json > $OUT/embedded.log 2>&1
echo "embedded rc=$?"; grep -v "compiling\|loading" $OUT/embedded.log | tail -25
mkdir -p /tmp/m
[ -f /tmp/m/qwen3-8b-bf16.gguf ] || timeout 200 python3 bench/make_model.py --shape qwen3-8b --type bf16 --vocab .bench_data/ggml-vocab-qwen2.gguf --out /tmp/m/qwen3-8b-bf16.gguf 2>&1 | tail -1
timeout 300 python3 bench/speculative.py --model /tmp/m/qwen3-8b-bf16.gguf --modes off ngram --concurrency 1 2 5 8 --waves 2 --max-tokens 128 --compile-cache-dir /tmp/xc --title "speculative decoding, random Qwen3-8B-shaped bf16, $G" --out $OUT/${D}_speculative_qwen3-8b-bf16_h200.json > $OUT/q8b.log 2>&1
echo "q8b rc=$?"; grep -v "compiling\|loading" $OUT/q8b.log | tail -12
