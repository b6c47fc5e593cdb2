#!/usr/bin/env bash
# full-budget decode at 512x1 and keep_0.33 at 2048x8 is too long here; 512x1 and 2048x1: before (f28eb6e) vs after (the cache-layer merge)
CLI='import sys; from condcomp.cli import main; sys.exit(main(sys.argv[1:]))'
SITE=/work/main/.venv/lib/python3.11/site-packages
for i in 1 2; do
  (cd /tmp/emptycwd && PYTHONPATH=/tmp/t_mid:$SITE taskset -c 1 python3 -c "$CLI" bench decode --model smollm2 --prompts 512 2048 --batches 1 --threads 1 --reps 6 --variants dense full keep_0.33 --out /work/layer_check/before_$i > /work/layer_check/before_$i.log 2>&1)
  (cd /work/main && taskset -c 1 .venv/bin/condcomp bench decode --model smollm2 --prompts 512 2048 --batches 1 --threads 1 --reps 6 --variants dense full keep_0.33 --out /work/layer_check/after_$i > /work/layer_check/after_$i.log 2>&1)
done
echo done
