#!/usr/bin/env bash
# The 2x2 that separates the difficulty target from BudgetFormer's router schedule (5 seeds run: README_2x2.md).
#
# The target study's +0.91 over fixed top-k at the same per-layer counts is confounded: its BudgetFormer arm alone
# trained with the exploration schedule (temperature 4 -> 1, noise 1.0 -> 0.2, mask temperature 1.0) while the
# fixed arms used topk's defaults. Here, on AG News with 5 seeds, each cell trains BudgetFormer with the target on
# or off and with the schedule on or off, and the fixed arms train with the SAME router options as that cell's
# BudgetFormer (--share-router-schedule), so BudgetFormer - fixed_per_layer differs only in the budget. Every
# BudgetFormer is also evaluated at each layer's most common count (budgetformer_mode_k).
#
# Cost (AG News, `small` preset, 1 epoch, one thread; the target study's seed 0 on a loaded 2-core CPU: standard
# 228 s, BudgetFormer 181 s, fixed_matched 160 s, fixed_per_layer 213 s of training, plus evaluation): about 14
# minutes per cell and seed; 4 cells x 5 seeds = 20 of them, i.e. 80 trained runs (each cell retrains its own
# standard model, the difficulty proxy, which is the same seeded run in every cell) and 20 mode-k evaluations,
# about 4.5 hours of one core; two jobs (two seed lists) about halve the wall time on 2 cores. Resumable: a
# finished (cell, seed) is skipped.
#
#   SEEDS="0 1 2" nohup nice -n 5 bash results/reproduction_target/run_2x2.sh > runs/2x2_a.log 2>&1 &
#   SEEDS="3 4"   nohup nice -n 5 bash results/reproduction_target/run_2x2.sh > runs/2x2_b.log 2>&1 &
#
# Then, per cell: condcomp report results/reproduction_2x2_<cell> --doc docs/results-2x2-<cell>.md; and the
# within-seed table of README_2x2.md: python results/reproduction_target/within_seed_2x2.py --extract "$OUT" --write
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${OUT:-runs/study_2x2}
source results/reproduction/study_settings.sh
SETTINGS="--preset small --max-len 128 --batch-size 32 --lr 1e-3 --threads 1 --latency-reps 10 --carbon-country USA --data-dir ../shared/data"
SCHEDULE='"router_options": {"temperature": {"kind": "exponential", "start": 4.0, "end": 1.0}, "noise_std": {"kind": "linear", "start": 1.0, "end": 0.2}, "mask_temperature": 1.0}'
declare -A OPTIONS=(
  [target_schedule]="{\"s_min\": 0.1, \"s_max\": 0.3, \"rounding\": \"round\", $SCHEDULE}"
  [target_default]="{\"s_min\": 0.1, \"s_max\": 0.3, \"rounding\": \"round\"}"
  [notarget_schedule]="{\"s_min\": 0.1, \"s_max\": 0.3, \"rounding\": \"round\", $SCHEDULE}"
  [notarget_default]="{\"s_min\": 0.1, \"s_max\": 0.3, \"rounding\": \"round\"}"
)
declare -A TARGET=([target_schedule]="--budget-target 10" [target_default]="--budget-target 10"
                   [notarget_schedule]="" [notarget_default]="")
ARMS="standard budgetformer budgetformer_mode_k fixed_matched fixed_per_layer"
for seed in ${SEEDS:-0 1 2 3 4}; do
  for cell in target_schedule target_default notarget_schedule notarget_default; do
    out=$BASE/$cell
    # shellcheck disable=SC2086
    $CONDCOMP ablate ${RUN[ag_news]} $SETTINGS --out "$out" --summary "results/reproduction_2x2_$cell/summary.json" \
      --seeds "$seed" --arms $ARMS --method budgetformer --method-options "${OPTIONS[$cell]}" \
      ${TARGET[$cell]} --share-router-schedule
  done
done
