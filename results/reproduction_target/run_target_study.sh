#!/usr/bin/env bash
# The study's AG News comparison with a budget that adapts: BudgetFormer trained with the difficulty target
# (--budget-target 10: each example's s pulled towards its loss rank in its batch, mapped onto [0.1, 0.3]; k =
# round(8 s), so the step between one and two heads lies inside the interval; the exploration schedule of the
# budget search), against fixed top-k at its matched head count and at its per-layer counts, random routing,
# and its own counts set to each layer's most common one. The study's settings otherwise (study_settings.sh).
# Resumable; one job per seed list, one torch thread:
#
#   SEEDS="0 2" nohup nice -n 5 bash results/reproduction_target/run_target_study.sh > runs/target_a.log 2>&1 &
#   SEEDS="1" nohup nice -n 5 bash results/reproduction_target/run_target_study.sh > runs/target_b.log 2>&1 &
#
# Then: condcomp report results/reproduction_target --doc docs/results-difficulty-target.md
set -euo pipefail
cd "$(dirname "$0")/../.."
SUMMARY_DIR=results/reproduction_target
OUT=${OUT:-runs/study_target}
source results/reproduction/study_settings.sh
COMMON=${COMMON/--summary results\/reproduction\/summary.json/--summary $SUMMARY_DIR/summary.json}
EXPLORE='"router_options": {"temperature": {"kind": "exponential", "start": 4.0, "end": 1.0}, "noise_std": {"kind": "linear", "start": 1.0, "end": 0.2}, "mask_temperature": 1.0}'
OPTIONS="{\"s_min\": 0.1, \"s_max\": 0.3, \"rounding\": \"round\", $EXPLORE}"
ARMS="standard budgetformer budgetformer_mode_k fixed_matched fixed_per_layer random_routing budgetformer_random_heads"
for seed in ${SEEDS:-0 1 2}; do
  $CONDCOMP ablate ${RUN[ag_news]} $COMMON --seeds $seed --arms $ARMS \
    --method budgetformer --method-options "$OPTIONS" --budget-target 10
done
