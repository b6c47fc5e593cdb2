#!/usr/bin/env bash
# One prepared call on a lent GPU machine for both GPU rows at once (the gathered executor's gpu-check and the compact
# cache's compiled decode), when the one call should give a first number on each rather than the whole of one:
# run_gpu.sh with the first FIRST_S seconds (gpu-check: its checks, then its target cells first), then
# run_gpu_decode.sh with the rest on SmolLM2's shape alone (variants keep_0.33, stream_0.33 and full beside dense).
# Each writes under its own folder: $OUT/gpu (as run_gpu.sh writes $OUT) and $OUT/decode (as run_gpu_decode.sh).
# A dry run on CPU:
#
#   OUT=/tmp/gpu_both DEVICE=cpu QUICK=1 PYTHON=.venv/bin/python bash results/bench/device/run_gpu_both.sh
#
# Settings (environment): BUDGET (seconds for the whole call, default 530), FIRST_S (run_gpu.sh's share, default 270;
# gpu-check gets it less 40 s), MODELS and VARIANTS (run_gpu_decode.sh's), and the two scripts' own settings.
set -u
BUDGET=${BUDGET:-530}
FIRST_S=${FIRST_S:-270}
OUT=${OUT:?set OUT to the folder to write into (the device tool sets it)}
here=$(cd "$(dirname "$0")" && pwd)
start=$(date +%s)
BUDGET=$FIRST_S GPU_CHECK_S=$(( FIRST_S - 40 )) OUT="$OUT/gpu" bash "$here/run_gpu.sh"
echo "run_gpu.sh exit $? at $(( $(date +%s) - start )) s"
rest=$(( BUDGET - ($(date +%s) - start) ))
BUDGET=$rest MODELS=${MODELS:-smollm2-shape} VARIANTS=${VARIANTS:-keep_0.33 stream_0.33 full} OUT="$OUT/decode" \
  bash "$here/run_gpu_decode.sh"
echo "run_gpu_decode.sh exit $? at $(( $(date +%s) - start )) s"
