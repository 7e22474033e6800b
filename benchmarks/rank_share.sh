#!/usr/bin/env bash
# One EP8 rank's share of a full-size MoE on one H200 (issues 22-25): every layer at real width
# with 1/8 of the routed experts (Kimi-K2: 61 layers of 48 experts, INT4 as K2-Thinking stores
# them; GLM-5: 78 layers of 32 experts, FP8 as GLM-5-FP8). Top-8 routing unchanged, so at batch
# B these experts see what an EP8 rank's see when each of the 8 attention ranks runs batch B;
# only the all-to-all is missing. One share per device call (each under ~9 minutes):
#   source .gpu/on-device.sh && SHARE=kimi-k2-int4:61:48 bash benchmarks/rank_share.sh
#   source .gpu/on-device.sh && SHARE=glm5-fp8:78:32 bash benchmarks/rank_share.sh
# SHARE is SHAPE:LAYERS:EXPERTS (a make-checkpoint shape). Steps, logs under $OUT/SHAPE:
#  1. sizes (CPU): `pegainfer-bench memory-plan` of the share on one GPU and of the full model
#     at DP8 + EP8; the share is refused if its weights pass 90% of this GPU's memory;
#  2. a config-only checkpoint (`make-checkpoint --no-weights`: 95-113 GB of weights fit
#     neither this disk nor the time), served with `--load-format dummy` (each tensor drawn in
#     place on the GPU); seconds to /health 200 measured from the launch;
#  3. `pegainfer-bench serve`: 1k/128 at concurrency 64 (one rank's decode batch), then 4k/64
#     at concurrency 1 (longer than GLM-5's 2,048-key selection: the sparse path);
#  4. GPU memory (nvidia-smi at idle and after serving; the engine's own "GPU memory:" plan);
#  5. the server stopped, `benchmarks/model_step.py` on the same share: decode b1/b64 at a 1k
#     context and prefill 4k, against the HBM and matmul limits measured in the same run.
# Every step has a time limit within BUDGET_S (default 500 s, so that with on-device.sh the call
# stays under the device tool's 600 s) from the start: a step that hangs costs only what is
# left after it. SERVER_ARGS are added to the server's flags.
# MODEL_DIR: where the config-only checkpoint goes (default /tmp/share-SHAPE).
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
: "${SHARE:?set SHARE=SHAPE:LAYERS:EXPERTS, e.g. kimi-k2-int4:61:48}"
IFS=: read -r SHAPE LAYERS EXPERTS <<< "$SHARE"
BUDGET_S=${BUDGET_S:-500}
PORT=${PORT:-8000}
REV=${PEGAINFER_REVISION:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LOG=$OUT/$SHAPE
MODEL=${MODEL_DIR:-/tmp/share-$SHAPE}  # the config-only checkpoint
mkdir -p "$LOG"
t0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - t0) )); }
within() { local cap=$1 rest; rest=$(left); (( rest < cap )) && cap=$rest; (( cap > 0 )) && echo "$cap" || echo 1; }
stamp() { echo "[$SHAPE t=$(( $(date +%s) - t0 ))s] $*"; }
gpu_memory() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits; }
archive() {  # at most eight files come back: the logs travel as one archive, built outside $OUT
  tar -czf /tmp/rank_share.tgz -C "$OUT" "$SHAPE" && rm -rf "$LOG" && mv /tmp/rank_share.tgz "$OUT/rank_share_$SHAPE.tgz"
}

# 1. Sizes, before anything touches the GPU.
{
  pegainfer-bench memory-plan "$SHAPE" --num-layers "$LAYERS" --num-experts "$EXPERTS"
  pegainfer-bench memory-plan "$SHAPE" --data-parallel-size 8
} > "$LOG/sizes.txt" 2>&1
stamp "sizes (rc $?):"; grep -E "bytes per GPU|total" "$LOG/sizes.txt"
share_gb=$(grep -m1 -E "^  total" "$LOG/sizes.txt" | awk '{print $2}')
total_mib=$(gpu_memory | head -1 | awk -F', ' '{print $2}')
if python3 -c "import sys; sys.exit(not $share_gb * 1e9 > 0.9 * $total_mib * 2**20)"; then
  stamp "the share's weights ($share_gb GB) pass 90% of this GPU's $total_mib MiB: not run"
  archive; exit 1
fi

# 2. Config-only checkpoint, then the server on weights drawn in place.
rm -rf "$MODEL"
timeout "$(within 120)" pegainfer-bench make-checkpoint "$SHAPE" "$MODEL" --num-layers "$LAYERS" \
  --num-experts "$EXPERTS" --no-weights > "$LOG/checkpoint.log" 2>&1
stamp "config written (rc $?)"
gpu_memory > "$LOG/gpu_memory_before.csv"
launched=$(date +%s.%N)
pegainfer-server --model-path "$MODEL" --load-format dummy --port "$PORT" --max-model-len 8192 \
  --max-num-seqs 64 ${SERVER_ARGS:-} > "$LOG/server.log" 2>&1 &
server=$!
ready=""
deadline=$(( $(date +%s) + $(within 330) ))
while (( $(date +%s) < deadline )) && kill -0 "$server" 2>/dev/null; do
  if curl -sf "localhost:$PORT/health" > /dev/null; then ready=$(date +%s.%N); break; fi
  sleep 0.5
done
if [ -z "$ready" ]; then
  stamp "server not ready (exited or past its limit): last lines of its log:"; tail -15 "$LOG/server.log"
  kill "$server" 2>/dev/null; wait "$server"; archive; exit 1
fi
ready_s=$(python3 -c "print(f'{$ready - $launched:.1f}')")
stamp "HTTP-ready in $ready_s s"
echo "{\"shape\": \"$SHAPE\", \"layers\": $LAYERS, \"experts\": $EXPERTS, \"revision\": \"$REV\", \"http_ready_s\": $ready_s}" > "$LOG/ready.json"
grep -E "start-up:|GPU memory:|KV cache:" "$LOG/server.log"
gpu_memory > "$LOG/gpu_memory_idle.csv"

# 3. Serving: one rank's decode batch, then one long prompt at a time.
timeout "$(within 100)" pegainfer-bench serve --base-url "http://127.0.0.1:$PORT" --input-len 1024 \
  --output-len 128 --num-prompts 128 --max-concurrency 64 --num-warmups 4 --seed 1 \
  --result-json "$LOG/serve_1k128_c64.json" > "$LOG/serve_1k128_c64.log" 2>&1
stamp "serve 1k/128 c64 (rc $?): $(grep -E "Output token throughput|Median TPOT" "$LOG/serve_1k128_c64.log" | tr -s ' ' | paste -sd';')"
timeout "$(within 60)" pegainfer-bench serve --base-url "http://127.0.0.1:$PORT" --input-len 4096 \
  --output-len 64 --num-prompts 4 --max-concurrency 1 --num-warmups 1 --seed 2 \
  --result-json "$LOG/serve_4k64_c1.json" > "$LOG/serve_4k64_c1.log" 2>&1
stamp "serve 4k/64 c1 (rc $?): $(grep -E "Median TTFT|Median TPOT" "$LOG/serve_4k64_c1.log" | tr -s ' ' | paste -sd';')"
gpu_memory > "$LOG/gpu_memory_served.csv"
stamp "GPU memory used/total MiB: before $(cat "$LOG/gpu_memory_before.csv"), idle $(cat "$LOG/gpu_memory_idle.csv"), served $(cat "$LOG/gpu_memory_served.csv")"
kill "$server"; wait "$server"
stamp "server stopped"

# 5. The step row on the same share (the server's GPU memory is free again).
timeout "$(within 240)" python3 benchmarks/model_step.py --shape "$SHAPE" --num-layers "$LAYERS" \
  --num-experts "$EXPERTS" --load-format dummy --batches 1,64 --prefill 4096 --steps 30 \
  --revision "$REV" --out "$LOG/model_step.json" > "$LOG/model_step.log" 2>&1
stamp "model_step (rc $?):"; grep -E "^\{" "$LOG/model_step.log"
archive
stamp "done: $OUT/rank_share_$SHAPE.tgz"
