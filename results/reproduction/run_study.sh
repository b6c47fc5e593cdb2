#!/usr/bin/env bash
# The learned-budget vs fixed top-k study, in the order that answers the question soonest.
# Resumable: every finished run (runs/study/DATASET/seedK/ARM/metrics.json + checkpoint) is skipped, so rerun
# this script to continue; each finished run is added to results/reproduction/summary.json at once.
# One job, one torch thread (the machine is shared). Then: condcomp report results/reproduction --doc docs/results.md
#
#   nohup bash results/reproduction/run_study.sh > runs/study.log 2>&1 &
#
# CONDCOMP=... overrides the command (default: the condcomp next to this venv's python, else on PATH);
# OUT=... the run folders (keep them: the paired tests read their per-example predictions);
# DATASETS="..." runs only those datasets' calls, e.g. two jobs on two cores (the summary is written under a lock):
#   DATASETS="ag_news snli dbpedia_14" nohup bash results/reproduction/run_study.sh > runs/study_a.log 2>&1 &
#   DATASETS="imdb yelp digits" nohup bash results/reproduction/run_study.sh > runs/study_b.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
source results/reproduction/study_settings.sh
MAIN="--arms standard budgetformer fixed_matched moh budgetformer_random_heads"
SWEEP="--sweep-fractions 0.125 0.25 0.5 0.75 1 --budget-costs 0.1 0.3 --moh-topk 4"

DATASETS=${DATASETS:-ag_news snli dbpedia_14 imdb yelp digits}
ablate() {
  local ds=$1; shift
  case " $DATASETS " in *" $ds "*) $CONDCOMP ablate ${RUN[$ds]} $COMMON "$@" ;; *) ;; esac
}

# 1. the two datasets the issue names, seed 0
ablate ag_news --seeds 0 $MAIN
ablate snli --seeds 0 $MAIN
# 2. the other datasets, seed 0 (cheapest first), the second modality; then its seeds 1 and 2
for ds in yelp dbpedia_14 digits imdb; do ablate $ds --seeds 0 $MAIN; done
ablate digits --seeds 0 1 2 $MAIN
# 3. seeds 1 and 2 everywhere
for ds in ag_news snli dbpedia_14 imdb yelp; do ablate $ds --seeds 0 1 2 $MAIN; done
# 4. the AG News Pareto sweep (fixed fractions, BudgetFormer with a price on heads, MoH at K = 4), 3 seeds
ablate ag_news --seeds 0 1 2 $MAIN $SWEEP
# 5. the sweep on the other datasets, seed 0 (Pareto curves per dataset)
for ds in snli dbpedia_14 imdb yelp digits; do ablate $ds --seeds 0 $MAIN $SWEEP; done
$CONDCOMP report results/reproduction --doc docs/results.md > /dev/null
