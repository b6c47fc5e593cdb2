#!/usr/bin/env bash
# The controls that separate a learned per-layer allocation from per-input adaptivity, and the adaptivity
# measures of every BudgetFormer run: per dataset and seed, budgetformer (with its adaptivity record and the
# evaluation-only controls budgetformer_mode_k and budgetformer_random_heads), fixed_per_layer, random_routing and
# standard (the difficulty proxy). budgetformer_random_heads is evaluated here again because a BudgetFormer whose run
# folder is gone is retrained, and the random-heads control must swap heads into that same model.
# The same settings as run_study.sh; resumable (finished runs are skipped); each finished run is added to
# results/reproduction/summary.json at once. One job per dataset list, one torch thread:
#
#   DATASETS="ag_news" nohup nice -n 10 bash results/reproduction/run_controls.sh > runs/controls_a.log 2>&1 &
#   DATASETS="dbpedia_14" nohup nice -n 10 bash results/reproduction/run_controls.sh > runs/controls_b.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
source results/reproduction/study_settings.sh
ARMS="budgetformer budgetformer_mode_k budgetformer_random_heads fixed_per_layer random_routing"
DATASETS=${DATASETS:-ag_news dbpedia_14 digits imdb yelp snli}
SEEDS=${SEEDS:-0 1 2}
for ds in $DATASETS; do
  for seed in $SEEDS; do
    # the new arms first, then the standard model (the difficulty proxy): the second call reuses the first's
    # runs and adds the budget's correlation with difficulty to the budgetformer record
    $CONDCOMP ablate ${RUN[$ds]} $COMMON --seeds $seed --arms $ARMS
    $CONDCOMP ablate ${RUN[$ds]} $COMMON --seeds $seed --arms standard $ARMS
  done
done
