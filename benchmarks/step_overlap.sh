#!/usr/bin/env bash
# The engine-step checks and timings of one GPU, in one device call (kernel caches restored
# by `.gpu/on-device.sh` first), written under $OUT:
#   STAGES="tests step" bash benchmarks/step_overlap.sh
# tests: the Qwen3 CUDA tests (graphs, piecewise graphs, async scheduling) and the GPU sampler;
# step:  benchmarks/model_step.py at Qwen3-4B shapes, batches 1/64/256 with and without a
#        1k-token prefill beside them, with and without --async-scheduling.
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

for stage in $STAGES; do
  case $stage in
    tests)
      timeout 420 python3 -m pytest -q -x -m "not slow" tests/qwen3/test_engine_gpu.py \
        tests/core/test_sampler_gpu.py > "$OUT/tests.log" 2>&1
      echo "tests: exit $? ($(tail -1 "$OUT/tests.log"))"
      ;;
    step)
      checkpoint
      for mode in sync async; do
        flag=""; [ $mode = async ] && flag="--async-scheduling"
        timeout 300 python3 benchmarks/model_step.py --shape "$SHAPE" --model-dir "$CKPT" \
          --batches "${BATCHES:-1,64,256}" --prefill 1024 --mixed-prompt 1024 --steps 30 \
          --revision "$REV" --out "$OUT/step_${SHAPE}_${mode}.json" $flag \
          > "$OUT/step_${mode}.log" 2>&1
        echo "step $mode: exit $?"; grep -E "^\{'batch'" "$OUT/step_${mode}.log"
      done
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
# At most eight files come back: the logs and JSONs travel as one archive.
tar -czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz --exclude 'jit.tgz.part*' . \
  && find "$OUT" -maxdepth 1 -type f ! -name results.tgz ! -name 'jit.tgz.part*' -delete
