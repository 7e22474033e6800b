#!/usr/bin/env bash
# Qwen3.5-4B under load (issue 20), in one device call (kernel caches restored by
# `.gpu/on-device.sh` first), written under $OUT as one archive:
#   STAGES="tests step serve multiturn" PEGAINFER_REVISION=REV bash benchmarks/qwen35_load.sh
# tests:     the Qwen3.5 GPU tests (kernels against their torch references, engine on CUDA);
# step:      benchmarks/model_step.py at Qwen3.5-4B shapes, decode batches 1/16/64 alone and
#            beside a 1k-token prompt, prefill 1k/4k, with kernel profiles of batches 16 and 64
#            (PROFILE overrides) beside the JSON;
# serve:     the issue's two serving rows: 1024/256 at 16 in flight (80 prompts) and 1k/128 at
#            64 in flight (128 prompts), against `pegainfer-server` with SERVER_FLAGS;
# multiturn: 20 conversations x 5 turns, 10 in flight (the prefix hits come back per turn);
# kernels:   benchmarks/qwen35_delta_rule.py: one DeltaNet layer's conv and delta rule at 4B
#            shapes (1k/4k prompts, 16/64 decodes beside a 1k prompt), per kernel (DELTA_SWEEP=1:
#            also the chunk kernels' launch parameters, each in a process of its own).
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
STAGES=${STAGES:-"tests step serve"}
CKPT=${CKPT:-/tmp/qwen35-4b}
REV=${PEGAINFER_REVISION:-unknown}
mkdir -p "$OUT"

checkpoint() {
  [ -f "$CKPT/config.json" ] && return
  pegainfer-bench make-checkpoint qwen35-4b "$CKPT" --tokenizer-from .gpu/qwen3tok \
    > "$OUT/checkpoint.log" 2>&1
}

serve_start() {
  local started=$SECONDS
  pegainfer-server --model-path "$CKPT" --port 8000 --max-model-len 20480 ${SERVER_FLAGS:-} \
    > "$OUT/server_$(date +%s).log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 480); do
    curl -sf localhost:8000/health > /dev/null && echo "server ready in $((SECONDS - started)) s" && return
    sleep 0.5
  done
  echo "server did not become ready"
}
serve_stop() { kill "$SERVER"; wait "$SERVER"; }

# One `pegainfer-bench serve` row: NAME then its arguments.
serve_row() {
  local name=$1; shift
  timeout 300 pegainfer-bench serve --request-rate inf --result-json "$OUT/serve_$name.json" "$@" \
    > "$OUT/serve_$name.log" 2>&1
  echo "serve $name: exit $?"; tail -25 "$OUT/serve_$name.log" | grep -iE "throughput|TTFT|TPOT"
}

for stage in $STAGES; do
  case $stage in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -m "not slow" \
        tests/qwen35/test_kernels_gpu.py tests/qwen35/test_engine_gpu.py ${MORE_TESTS:-} \
        > "$OUT/tests.log" 2>&1
      echo "tests: exit $? ($(tail -1 "$OUT/tests.log"))"
      grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -8
      ;;
    step)
      checkpoint
      timeout 400 python3 benchmarks/model_step.py --shape qwen35-4b --model-dir "$CKPT" \
        --batches "${BATCHES:-1,16,64}" --prefill 1024,4096 --mixed-prompt 1024 --steps 30 \
        --profile "${PROFILE:-16,64}" --revision "$REV" --out "$OUT/step_qwen35_4b.json" \
        > "$OUT/step.log" 2>&1
      echo "step: exit $?"; grep -E '^\{' "$OUT/step.log"
      ;;
    serve)
      checkpoint
      serve_start
      serve_row c16_1k256 --input-len 1024 --output-len 256 --num-prompts 80 \
        --max-concurrency 16 --num-warmups 4 --seed 300
      serve_row c64_1k128 --input-len 1024 --output-len 128 --num-prompts 128 \
        --max-concurrency 64 --num-warmups 4 --seed 301
      serve_stop
      ;;
    multiturn)
      checkpoint
      serve_start
      timeout 240 pegainfer-bench multiturn --conversations 20 --turns 5 --concurrency 10 \
        --first-turn-len 4096 --turn-len 1024 --output-len 128 \
        --result-json "$OUT/multiturn.json" > "$OUT/multiturn.log" 2>&1
      echo "multiturn: exit $?"; tail -14 "$OUT/multiturn.log"
      serve_stop
      ;;
    kernels)
      timeout 300 python3 benchmarks/qwen35_delta_rule.py --out "$OUT/delta_rule.json" \
        ${DELTA_SWEEP:+--sweep --cases prompt_1k,decode_64_beside_1k} > "$OUT/delta_rule.log" 2>&1
      echo "kernels: exit $?"; grep -E '^\{' "$OUT/delta_rule.log"
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
# At most eight files come back: the logs and JSONs travel as one archive.
tar -czf /tmp/results.tgz -C "$OUT" --exclude 'jit.tgz.part*' . \
  && find "$OUT" -maxdepth 1 -type f ! -name 'jit.tgz.part*' -delete \
  && find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + \
  && mv /tmp/results.tgz "$OUT/"
