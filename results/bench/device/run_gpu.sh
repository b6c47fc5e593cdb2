#!/usr/bin/env bash
# One prepared call on a lent GPU machine (one H100 or H200; torch with CUDA and triton installed, no network):
# `condcomp bench gpu-check`, then, with the time left, the compact cache's split-K decode kernel (its CUDA test where
# pytest is, `condcomp bench decode --compile` on the tiny Llama with a `keep_0.25+kernel` variant where transformers
# is), then `condcomp bench compile --device cuda` where that flag exists.
# Everything it writes goes under $OUT (what the device tool brings back). results/bench/device/README.md gives the
# exact call; a dry run on CPU:
#
#   OUT=/tmp/gpu_out DEVICE=cpu QUICK=1 PYTHON=.venv/bin/python bash results/bench/device/run_gpu.sh
#
# Settings (environment): BUDGET (seconds for the whole script, default 530: the call's timeout_s less a margin),
# GPU_CHECK_S (gpu-check's --budget-s, default 450), DEVICE (cuda), QUICK=1 (tiny shapes), PYTHON (python3),
# GPU_CHECK_ARGS (more gpu-check flags, e.g. "--compile off"), INSTALL=copy (skip pip, see below), KERNEL_S (seconds
# for the decode kernel's step, default 150; it runs only with 60 s left, so GPU_CHECK_S=300 makes room for it).
#
# Install: condcomp maps the top-level folders routers/, policies/ and integrations/ into the package (pyproject's
# package-dir), so the checkout itself is not importable with PYTHONPATH alone. `pip install --no-deps --no-index
# --no-build-isolation --target` builds it with the machine's setuptools; where that fails, the package is assembled
# the same way by copying. gpu-check needs nothing beyond torch (no transformers, no numpy, no data, no wheels).
set -u
BUDGET=${BUDGET:-530}
GPU_CHECK_S=${GPU_CHECK_S:-450}
source "$(dirname "$0")/setup.sh"

# 1. gpu-check: the checks, then the cells in priority order within its own budget
gc_budget=$(( $(left) - 40 < GPU_CHECK_S ? $(left) - 40 : GPU_CHECK_S )); [ "$gc_budget" -lt 30 ] && gc_budget=30
timeout $(( gc_budget + 30 )) "$PY" -m condcomp.bench.gpu_check --device "$DEVICE" --budget-s "$gc_budget" \
  --out "$OUT/gpu_check" $QUICK_FLAG ${GPU_CHECK_ARGS:-} > "$OUT/gpu_check.log" 2>&1
echo "gpu-check exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_check.log"

# 2. the split-K decode kernel (condcomp/kv/kernels): its CUDA test (float32, bfloat16, float16 against a float64
# loop), then the tiny Llama decoding compiled with and without it (bench decode --compile; inductor on cuda)
if [ "$(left)" -lt 60 ]; then
  echo "skipped: $(left) s left of BUDGET=$BUDGET" > "$OUT/decode_kernel.log"
else
  kernel_end=$(( $(date +%s) + ( $(left) - 10 < ${KERNEL_S:-150} ? $(left) - 10 : ${KERNEL_S:-150} ) ))
  kleft() { echo $(( kernel_end - $(date +%s) )); }
  if "$PY" -c "import pytest" 2>/dev/null; then
    timeout $(( $(kleft) < 120 ? $(kleft) : 120 )) "$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" \
      "$ROOT/tests/kv/test_decode_kernel.py" -k cuda > "$OUT/decode_kernel.log" 2>&1
    echo "decode kernel test exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/decode_kernel.log"
  else
    echo "skipped the kernel's CUDA test: no pytest on this machine" > "$OUT/decode_kernel.log"
  fi
  backend=$([ "$DEVICE" = cuda ] && echo inductor || echo eager)  # a CPU dry run checks the capture alone
  if ! "$PY" -c "import transformers" 2>/dev/null; then
    echo "skipped bench decode: no transformers on this machine" >> "$OUT/decode_kernel.log"
  elif [ "$(kleft)" -lt 45 ]; then
    echo "skipped bench decode: $(kleft) s left of KERNEL_S" >> "$OUT/decode_kernel.log"
  else
    timeout -k 15 "$(kleft)" "$PY" -m condcomp.cli bench decode --model tiny-llama --device "$DEVICE" --compile \
      --compile-backend "$backend" --variants keep_0.25 keep_0.25+kernel --prompts 1024 --batches 16 \
      --new-tokens 16 --reps 1 --threads 2 --out "$OUT/decode_kernel" $QUICK_FLAG >> "$OUT/decode_kernel.log" 2>&1
    echo "bench decode (kernel) exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/decode_kernel.log"
  fi
fi

# 3. bench compile on the device, if this checkout's command has --device and time is left
if ! "$PY" -m condcomp.cli bench compile --help 2>/dev/null | grep -q -- "--device"; then
  echo "skipped: this checkout's condcomp bench compile has no --device flag" > "$OUT/compile.log"
elif [ "$(left)" -lt 60 ]; then
  echo "skipped: $(left) s left of BUDGET=$BUDGET" > "$OUT/compile.log"
else
  timeout $(( $(left) - 10 )) "$PY" -m condcomp.cli bench compile --device "$DEVICE" --out "$OUT/compile" \
    $QUICK_FLAG > "$OUT/compile.log" 2>&1
  echo "bench compile exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/compile.log"
fi
tail -40 "$OUT/gpu_check/table.md" 2>/dev/null
cat "$OUT/decode_kernel/table.md" 2>/dev/null
echo "all done at $(( $(date +%s) - start )) s"
rm -rf "$W"
