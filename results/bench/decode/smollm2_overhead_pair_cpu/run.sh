#!/usr/bin/env bash
# full-budget decode at 512x1 before (5adf450) and after the overhead cuts (main), alternated, on core 1
CLI='import sys; from condcomp.cli import main; sys.exit(main(sys.argv[1:]))'
SITE=/work/main/.venv/lib/python3.11/site-packages
for i in 1 2; do
  (cd /tmp/emptycwd && PYTHONPATH=/tmp/t_after:$SITE taskset -c 1 python3 -c "$CLI" bench decode --model smollm2 --prompts 512 --batches 1 --threads 1 --reps 10 --variants dense full --out /work/ovh_check/before_$i > /work/ovh_check/before_$i.log 2>&1)
  (cd /work/main && taskset -c 1 .venv/bin/condcomp bench decode --model smollm2 --prompts 512 --batches 1 --threads 1 --reps 10 --variants dense full --out /work/ovh_check/after_$i > /work/ovh_check/after_$i.log 2>&1)
done
echo done
