#!/usr/bin/env bash
# The paper's setting on one GPU (prepared, not yet run on a GPU).
#
# BudgetFormer as its paper reports it: encoder of 4 layers, 8 heads, d = 768 (FFN 3072), trained from
# scratch per task, AdamW lr 2e-5, batch 16, 10 epochs; here on the staged subsets of ../shared/data (the full
# datasets are not staged), max_len 256, every arm x 3 seeds, plus the Pareto sweep on every dataset.
#
# Size: AG News is 19,129 rows -> 11,960 steps per run at batch 16 (IMDB 12,500, SNLI 12,500, DBpedia 5,000,
# Yelp 2,500). At an estimated 15-25 ms per step for this model on one H100/H200 (not measured), one run is
# 1-5 minutes, and the whole script (~5 datasets x 12 trained arms x 3 seeds = 180 runs) about 6-10 GPU hours.
# Resumable like the CPU study: rerun it to continue. Results go to a separate summary (not the CPU one).
#
#   nohup bash results/reproduction/gpu_paper_setting.sh > runs/paper.log 2>&1 &
#   condcomp report results/paper --doc docs/results_paper.md
set -euo pipefail
cd "$(dirname "$0")/../.."
CONDCOMP=${CONDCOMP:-condcomp}
COMMON="--preset paper --max-len 256 --batch-size 16 --lr 2e-5 --epochs 10 --warmup 0.06 --eval-batch-size 256"
COMMON="$COMMON --device cuda --latency-reps 30 --carbon-country USA --data-dir ../shared/data"
COMMON="$COMMON --out runs/paper --summary results/paper/summary.json"
MAIN="--arms standard budgetformer fixed_matched moh budgetformer_random_heads budgetformer_forced_matched"
SWEEP="--sweep-fractions 0.125 0.25 0.5 0.75 1 --budget-costs 0.1 0.3 --moh-topk 4"
for ds in ag_news snli dbpedia_14 imdb yelp; do
  $CONDCOMP ablate --dataset $ds $COMMON --seeds 0 1 2 $MAIN $SWEEP
done
$CONDCOMP report results/paper --doc docs/results_paper.md > /dev/null
