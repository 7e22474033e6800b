#!/usr/bin/env bash
# Issue 21's start-up rows in one device call, written under $OUT as one archive:
#   source .gpu/on-device.sh && PEGAINFER_REVISION=REV bash benchmarks/startup.sh
# tests:   the GPU tests of the start-up work (shared FlashInfer plan buffers; no Triton
#          specialization made after the warm-up; weights through page-locked staging; the
#          steps launch only what the kernel plan precompiled; decode graphs captured while
#          serving decode as ones captured up front);
# startup: per model line (SHAPES: Qwen3-4B, Qwen3.5-4B, DeepSeek-V2-Lite shapes with random
#          weights from make-checkpoint), `pegainfer-bench startup`: COLD_RUNS starts with empty
#          FlashInfer, Triton and CUDA kernel caches and the page cache dropped (the first also
#          fills the warm cache), then WARM_RUNS starts on it, then DISK_COLD_RUNS with the
#          kernel caches warm and the page cache dropped; each records the time to
#          /health 200, the idle RSS of the process tree, GPU memory and the server's start-up
#          phases (time and RSS).
# floor:   benchmarks/rss_floor.py --glibc (the resident floor of torch, CUDA, cuBLAS, FlashInfer,
#          Triton and a graph, step by step) and benchmarks/weight_load.py on the Qwen3-4B
#          checkpoint from the page cache (load GB/s by reader threads, beside the page cache's
#          and the bus's rates); seconds each. Not in the default STAGES: STAGES=floor.
# Without CACHE_DIR the caches `.gpu/on-device.sh` restored in ~ go unused (the first cold run
# fills a fresh one); CACHE_DIR=~ makes the warm and disk-cold runs use them (with
# COLD_RUNS=0: a warm-only pass, no compiling). A line whose checkpoint is missing is written first (seconds to a minute; not timed;
# DeepSeek-V2-Lite's is ~31 GB). Cold runs compile every kernel (one to two minutes a line):
# with all three lines, run them in two calls (SHAPES=qwen3-4b, then the other two).
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
STAGES=${STAGES:-"tests startup"}
SHAPES=${SHAPES:-"qwen3-4b qwen35-4b deepseek-v2-lite"}
COLD_RUNS=${COLD_RUNS:-1}
WARM_RUNS=${WARM_RUNS:-2}
DISK_COLD_RUNS=${DISK_COLD_RUNS:-1}
SERVER_ARGS=${SERVER_ARGS:---max-model-len 20480}
REV=${PEGAINFER_REVISION:-unknown}
mkdir -p "$OUT"

checkpoint() {  # SHAPE DIR
  [ -f "$2/config.json" ] && return
  local tokenizer=(--tokenizer-from .gpu/qwen3tok)
  [ "$1" = deepseek-v2-lite ] && tokenizer=()  # the line's own small tokenizer
  pegainfer-bench make-checkpoint "$1" "$2" "${tokenizer[@]}" > "$OUT/checkpoint_$1.log" 2>&1
  echo "checkpoint $1: exit $? ($(tail -1 "$OUT/checkpoint_$1.log"))"
}

for stage in $STAGES; do
  case $stage in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/core/test_plan_buffers_gpu.py \
        tests/core/test_warmup_gpu.py tests/core/test_staging_gpu.py \
        tests/core/test_kv_sizing_gpu.py tests/core/test_precompile_gpu.py \
        tests/core/test_lazy_graphs_gpu.py tests/core/test_early_cuda.py ${MORE_TESTS:-} \
        > "$OUT/tests.log" 2>&1
      echo "tests: exit $? ($(tail -1 "$OUT/tests.log"))"
      ;;
    floor)
      python3 benchmarks/rss_floor.py --glibc --json "$OUT/rss_floor.json" > "$OUT/rss_floor.log" 2>&1
      echo "rss_floor: exit $?"; cat "$OUT/rss_floor.log"
      checkpoint qwen3-4b /tmp/qwen3-4b
      cat /tmp/qwen3-4b/*.safetensors > /dev/null  # into the page cache
      timeout 300 python3 benchmarks/weight_load.py /tmp/qwen3-4b --readers 1 4 8 --repeat 2 \
        > "$OUT/weight_load.log" 2>&1
      echo "weight_load: exit $?"; cat "$OUT/weight_load.log"
      ;;
    startup)
      for shape in $SHAPES; do
        ckpt=/tmp/$shape
        checkpoint "$shape" "$ckpt"
        timeout 420 pegainfer-bench startup --model-path "$ckpt" --cold-runs "$COLD_RUNS" \
          ${CACHE_DIR:+--cache-dir "$CACHE_DIR"} \
          --warm-runs "$WARM_RUNS" --disk-cold-runs "$DISK_COLD_RUNS" --drop-page-cache \
          --server-args "$SERVER_ARGS" \
          --log-dir "$OUT/startup_$shape" --result-json "$OUT/startup_${shape}_$REV.json" \
          > "$OUT/startup_$shape.log" 2>&1
        echo "startup $shape: exit $?"; grep -E "run [0-9]+:" "$OUT/startup_$shape.log"
      done
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
# At most eight files come back: the logs and JSONs travel as one archive.
# (Built outside $OUT: tar fails on an archive growing inside the folder it reads.)
tar -czf /tmp/results.tgz -C "$OUT" --exclude 'jit.tgz.part*' . \
  && find "$OUT" -mindepth 1 -maxdepth 1 ! -name 'jit.tgz.part*' -exec rm -rf {} + \
  && mv /tmp/results.tgz "$OUT/"
