#!/usr/bin/env bash
# One prepared call on a lent GPU machine (one H100 or H200; torch with CUDA, triton and transformers installed, no
# network) for the compact KV cache's GPU rows (issue 51): `condcomp bench decode --compile` on random-weight models of
# SmolLM2-135M's and Llama-3.2-1B's shapes (speed needs no trained weights, so no GGUF file is carried), bfloat16, a
# prompt of 4096 tokens x 32 requests, every variant decoded eagerly and under torch.compile(fullgraph=True,
# mode="reduce-overhead"): CUDA graphs, as transformers' own static-cache decode. Variants: dense (transformers'
# StaticCache), full (condcomp's cache at the full budget), keep_0.33 (a third of the KV groups, the others dropped),
# keep_0.33+kernel (the same attending through the split-K kernel, one launch per layer), stream_0.33 (the DuoAttention
# shape: a third of the groups full, the others a window of 4 sinks + 252 recent tokens).
# Each model runs in its own process with its own time limit (SmolLM2's shape first); each writes
# $OUT/decode_<model>/{metrics.json,table.md} and $OUT/decode_<model>.log. At its time limit `timeout` sends SIGTERM:
# bench decode then writes the steps that ran, marked "stopped", and exits 124 (KILL follows 20 s later if it hangs).
# A dry run on CPU (a few minutes):
#
#   OUT=/tmp/gpu_decode DEVICE=cpu QUICK=1 PYTHON=.venv/bin/python bash results/bench/device/run_gpu_decode.sh
#
# Settings (environment): BUDGET (seconds for the whole script, default 530), MODELS (default "smollm2-shape
# llama-1b-shape"), DTYPE (bfloat16), PROMPT (4096), BATCH (32), NEW_TOKENS (16), VARIANTS, DEVICE (cuda), QUICK=1,
# PYTHON (python3), INSTALL=copy (skip pip; see run_gpu.sh).
set -u
BUDGET=${BUDGET:-530}
source "$(dirname "$0")/setup.sh"

MODELS=${MODELS:-smollm2-shape llama-1b-shape}
VARIANTS=${VARIANTS:-full keep_0.33 keep_0.33+kernel stream_0.33}
backend=$([ "$DEVICE" = cuda ] && echo inductor || echo eager)  # a CPU dry run checks the capture alone
if ! "$PY" -c "import transformers" 2>/dev/null; then
  echo "no transformers on this machine: bench decode cannot run" | tee "$OUT/decode.log"; exit 4
fi
n=$(echo $MODELS | wc -w); i=0
for model in $MODELS; do
  i=$(( i + 1 ))
  share=$(( ($(left) - 10) / (n - i + 1) ))  # the time left, shared by the models still to run
  [ $i -lt $n ] && share=$(( share * 5 / 4 ))  # the first (smaller) model gets a little more: it warms the caches
  if [ "$share" -lt 60 ]; then echo "skipped $model: $(left) s left of BUDGET=$BUDGET" > "$OUT/decode_$model.log"; continue; fi
  timeout -k 20 "$share" "$PY" -m condcomp.cli bench decode --model "$model" --device "$DEVICE" --dtype "${DTYPE:-bfloat16}" \
    --compile --compile-backend "$backend" --variants $VARIANTS --prompts "${PROMPT:-4096}" --batches "${BATCH:-32}" \
    --new-tokens "${NEW_TOKENS:-16}" --reps 1 --threads 4 --out "$OUT/decode_$model" $QUICK_FLAG \
    > "$OUT/decode_$model.log" 2>&1
  echo "bench decode $model exit $? at $(( $(date +%s) - start )) s (limit $share s)" | tee -a "$OUT/decode_$model.log"
  cat "$OUT/decode_$model/table.md" 2>/dev/null
done
echo "all done at $(( $(date +%s) - start )) s"
rm -rf "$W"
