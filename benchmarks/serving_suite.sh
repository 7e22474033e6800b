#!/usr/bin/env bash
# The serving suite of docs/benchmarks for one Qwen3 shape on one GPU, results under OUT_DIR.
#
#   RATES=1,4,8,16,24,32 bash benchmarks/serving_suite.sh qwen3-4b OUT_DIR
#
# Random weights at the real shape (`pegainfer-bench make-checkpoint`; TOKENIZER_FROM=DIR puts
# a real tokenizer in it), then: transformers' generate at batch 1 (the naive baseline),
# start-up and idle memory (warm caches; COLD=1 adds one run with empty kernel caches), and
# against one server: the warm-prefix ladder, the 1k/128 sweep over RATES (SWEEP_SECONDS of
# arrivals per rate), concurrency 1 at 4k/64 and, with MULTITURN=1, the multi-turn run.
# EXTRA_SERVER_ARGS (e.g. "--async-scheduling --kv-offload") go to every server it starts.
# Every step has a time limit, so one that hangs costs only its own results.
set -u
SHAPE=$1
OUT=$2
RATES=${RATES:-1,4,8,16,24,32}
SWEEP_SECONDS=${SWEEP_SECONDS:-15}
MODEL=${MODEL_DIR:-/tmp/$SHAPE}
SERVER_ARGS="--max-model-len 20480 ${EXTRA_SERVER_ARGS:-}"
export PEGAINFER_REVISION=${PEGAINFER_REVISION:-$(git rev-parse HEAD 2>/dev/null)}
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$SHAPE t=$(( $(date +%s) - t0 ))s] $*"; }

if [ ! -f "$MODEL/config.json" ]; then
  timeout 300 pegainfer-bench make-checkpoint "$SHAPE" "$MODEL" \
    ${TOKENIZER_FROM:+--tokenizer-from "$TOKENIZER_FROM"} > "$OUT/checkpoint.log" 2>&1
  stamp "checkpoint written (rc $?)"
fi
timeout 150 python benchmarks/hf_generate.py --model-path "$MODEL" --revision "$PEGAINFER_REVISION" \
  --out "$OUT/hf_generate.json" > "$OUT/hf_generate.log" 2>&1
stamp "transformers generate (rc $?)"
timeout 400 pegainfer-bench startup --model-path "$MODEL" --cold-runs "${COLD:-0}" \
  --warm-runs 2 --cache-dir "$HOME" --server-args "$SERVER_ARGS" \
  --result-json "$OUT/startup.json" > "$OUT/startup.log" 2>&1
stamp "startup (rc $?)"

pegainfer-server --model-path "$MODEL" --port 8000 $SERVER_ARGS > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 1 240); do curl -sf localhost:8000/health > /dev/null && break; sleep 0.5; done
stamp "server ready"
timeout 90 pegainfer-bench prefix --lengths 256,1024,4096,16384 --warm-runs 10 \
  --result-json "$OUT/prefix.json" > "$OUT/prefix.log" 2>&1
stamp "warm-prefix ladder (rc $?)"
timeout 300 pegainfer-bench serve --input-len 1024 --output-len 128 --sweep "$RATES" \
  --sweep-seconds "$SWEEP_SECONDS" --num-warmups 8 --seed 100 --result-dir "$OUT/sweep" \
  > "$OUT/sweep.log" 2>&1
stamp "1k/128 sweep (rc $?; without matplotlib the plot is drawn later from the JSONs)"
timeout 60 pegainfer-bench serve --input-len 4096 --output-len 64 --num-prompts 16 \
  --max-concurrency 1 --num-warmups 1 --seed 200 --result-json "$OUT/c1_4k64.json" \
  > "$OUT/c1_4k64.log" 2>&1
stamp "concurrency 1, 4k/64 (rc $?)"
if [ "${MULTITURN:-0}" = 1 ]; then
  timeout 200 pegainfer-bench multiturn --conversations 20 --turns 5 --concurrency 10 \
    --first-turn-len 4096 --turn-len 1024 --output-len 128 \
    --result-json "$OUT/multiturn.json" > "$OUT/multiturn.log" 2>&1
  stamp "multi-turn (rc $?)"
fi
kill "$server"
wait "$server"
stamp "done"
