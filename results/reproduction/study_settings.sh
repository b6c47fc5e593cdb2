# The study's settings, shared by run_study.sh and run_controls.sh (sourced, from the repository root).
# CONDCOMP=... overrides the command; OUT=... the run folders.
CONDCOMP=${CONDCOMP:-$( [ -x .venv/bin/condcomp ] && echo .venv/bin/condcomp || echo condcomp )}
OUT=${OUT:-runs/study}
SUMMARY=results/reproduction/summary.json
COMMON="--preset small --max-len 128 --batch-size 32 --lr 1e-3 --threads 1 --latency-reps 10 --carbon-country USA"
COMMON="$COMMON --data-dir ../shared/data --out $OUT --summary $SUMMARY"
# Training length per dataset (epochs over the staged train split).
declare -A RUN=(
  [ag_news]="--dataset ag_news --epochs 1"
  [snli]="--dataset snli --epochs 3"
  [dbpedia_14]="--dataset dbpedia_14 --epochs 3"
  [imdb]="--dataset imdb --epochs 1"
  [yelp]="--dataset yelp --epochs 3"
  [digits]="--dataset digits --epochs 10"
)
