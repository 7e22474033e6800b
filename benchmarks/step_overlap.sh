#!/usr/bin/env bash
# The engine-step checks and timings of one GPU, in one device call (kernel caches restored
# by `.gpu/on-device.sh` first), written under $OUT:
#   STAGES="tests step serve multiturn" bash benchmarks/step_overlap.sh
# MORE_TESTS adds test paths to the tests stage; PROFILE=1,256 writes kernel tables and host
# phases of those decode batches (and of their mixed steps) beside the step JSONs;
# SERVER_ARGS_EXTRA adds flags to every server start (serve and multiturn), beside each
# SERVE_MODES entry's own. Step budgets side by side, e.g. (one line):
#   STAGES=serve SERVE_MODES="--max-num-batched-tokens 2048;--max-num-batched-tokens 4096;--max-num-batched-tokens 8192" bash benchmarks/step_overlap.sh
# tests: the Qwen3 CUDA tests (graphs, piecewise graphs, async scheduling) and the GPU sampler;
# step:  benchmarks/model_step.py at Qwen3-4B shapes, batches 1/64/256 with and without a
#        1k-token prefill beside them, with async scheduling (the default) and without;
# serve: saturated 1k/128 serving of Qwen3-4B (384 prompts, 256 in flight, as issue 19 asks)
#        for each server flag set in SERVE_MODES, then the warm-prefix ladder on the last one;
# multiturn: Qwen3-8B's multi-turn run for each server flag set in MULTITURN_MODES (default:
#        none), then its batch-1 decode step.
# Each stage's log and JSON go to $OUT; PEGAINFER_REVISION names the revision measured (the
# GPU host has no git).
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
STAGES=${STAGES:-"tests step"}
SHAPE=${SHAPE:-qwen3-4b}
CKPT=${CKPT:-/tmp/$SHAPE}
REV=${PEGAINFER_REVISION:-unknown}
mkdir -p "$OUT"

checkpoint() {
  [ -f "$CKPT/config.json" ] && return
  pegainfer-bench make-checkpoint "$SHAPE" "$CKPT" --tokenizer-from .gpu/qwen3tok \
    > "$OUT/checkpoint.log" 2>&1
}

# A server on port 8000 for the model at $1 with the flags that follow (and
# SERVER_ARGS_EXTRA's); says how long it took to become ready; serve_stop ends it.
serve_start() {
  local model=$1; shift
  local started=$SECONDS
  # shellcheck disable=SC2086  # SERVER_ARGS_EXTRA is a list of flags
  pegainfer-server --model-path "$model" --port 8000 --max-model-len 20480 "$@" \
    ${SERVER_ARGS_EXTRA:-} > "$OUT/server_$(basename "$model")_$(date +%s).log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 360); do
    if curl -sf localhost:8000/health > /dev/null; then
      echo "server [$* ${SERVER_ARGS_EXTRA:-}] ready in $((SECONDS - started)) s"; return
    fi
    sleep 0.5
  done
  echo "server [$* ${SERVER_ARGS_EXTRA:-}] did not become ready in $((SECONDS - started)) s"
}
serve_stop() { kill "$SERVER"; wait "$SERVER"; }

for stage in $STAGES; do
  case $stage in
    tests)
      timeout 420 python3 -m pytest -q -m "not slow" tests/qwen3/test_engine_gpu.py \
        tests/core/test_sampler_gpu.py ${MORE_TESTS:-} > "$OUT/tests.log" 2>&1
      echo "tests: exit $? ($(tail -1 "$OUT/tests.log"))"
      ;;
    step)
      checkpoint
      for mode in sync async; do
        flag=""; [ $mode = sync ] && flag="--no-async-scheduling"
        timeout 300 python3 benchmarks/model_step.py --shape "$SHAPE" --model-dir "$CKPT" \
          --batches "${BATCHES:-1,64,256}" --prefill 1024 --mixed-prompt 1024 --steps 30 \
          --revision "$REV" --out "$OUT/step_${SHAPE}_${mode}.json" $flag \
          ${PROFILE:+--profile $PROFILE} \
          > "$OUT/step_${mode}.log" 2>&1
        echo "step $mode: exit $?"; grep -E "^\{'batch'" "$OUT/step_${mode}.log"
      done
      ;;
    serve)
      checkpoint
      IFS=";" read -ra modes <<< "${SERVE_MODES:---no-async-scheduling; }"
      for mode in "${modes[@]}"; do
        name=$(echo "$mode" | tr -d ' -' | cut -c1-40); name=${name:-default}
        serve_start "$CKPT" $mode
        timeout 240 pegainfer-bench serve --input-len 1024 --output-len 128 --num-prompts 384 \
          --max-concurrency 256 --request-rate inf --num-warmups 8 --seed 100 \
          --result-json "$OUT/serve_${name}.json" > "$OUT/serve_${name}.log" 2>&1
        echo "serve [$mode]: exit $?"; tail -25 "$OUT/serve_${name}.log" | grep -iE "throughput|TTFT|TPOT"
        if [ "$mode" = "${modes[-1]}" ]; then
          timeout 120 pegainfer-bench prefix --lengths 1024,4096,16384 --warm-runs 10 \
            --result-json "$OUT/prefix.json" > "$OUT/prefix.log" 2>&1
          echo "prefix: exit $?"; tail -8 "$OUT/prefix.log"
        fi
        serve_stop
      done
      ;;
    multiturn)
      big=/tmp/qwen3-8b
      [ -f $big/config.json ] || pegainfer-bench make-checkpoint qwen3-8b $big \
        --tokenizer-from .gpu/qwen3tok > "$OUT/checkpoint8b.log" 2>&1
      IFS=";" read -ra modes <<< "${MULTITURN_MODES:- }"
      for mode in "${modes[@]}"; do
        name=$(echo "$mode" | tr -d ' -' | cut -c1-40); name=${name:-default}
        serve_start $big $mode
        timeout 200 pegainfer-bench multiturn --conversations 20 --turns 5 --concurrency 10 \
          --first-turn-len 4096 --turn-len 1024 --output-len 128 \
          --result-json "$OUT/multiturn_8b_${name}.json" > "$OUT/multiturn_${name}.log" 2>&1
        echo "multiturn [$mode]: exit $?"; tail -16 "$OUT/multiturn_${name}.log"
        serve_stop
      done
      timeout 200 python3 benchmarks/model_step.py --shape qwen3-8b --model-dir $big \
        --batches 1 --prefill 1024 --steps 30 --revision "$REV" \
        --out "$OUT/step_qwen3-8b.json" > "$OUT/step_8b.log" 2>&1
      echo "step 8b: exit $?"; grep -E "^\{'batch'" "$OUT/step_8b.log"
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
# At most eight files come back: the logs and JSONs travel as one archive.
# (Built outside $OUT: tar fails on an archive growing inside the folder it reads.)
tar -czf /tmp/results.tgz -C "$OUT" --exclude 'jit.tgz.part*' . \
  && find "$OUT" -maxdepth 1 -type f ! -name 'jit.tgz.part*' -delete \
  && mv /tmp/results.tgz "$OUT/"
