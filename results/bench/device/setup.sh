# Sourced by the prepared device scripts (run_gpu.sh, run_gpu_decode.sh): from the repository root, write
# $OUT/machine.txt, install condcomp from the copied tree into a temporary site folder (no network) and cd into an empty
# folder. Sets ROOT, OUT, PY, DEVICE, BUDGET, QUICK_FLAG, W (the temporary folder), start and left() (seconds of
# BUDGET left). The caller sets BUDGET's default before sourcing.
cd "$(dirname "$0")/../../.."
ROOT=$(pwd)
OUT=${OUT:?set OUT to the folder to write into (the device tool sets it)}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
QUICK_FLAG=$([ "${QUICK:-0}" = 1 ] && echo --quick || true)
case "$PY" in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # it runs from another folder
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d)
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
mkdir -p "$OUT" "$W/site" "$W/run"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
CONDCOMP_COMMIT=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo "unknown (no .git in the copied tree)")
[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ] && CONDCOMP_COMMIT="$CONDCOMP_COMMIT+dirty"
export CONDCOMP_COMMIT

{ date -u; nvidia-smi 2>&1 | head -15; echo "nproc $(nproc)"; echo "commit $CONDCOMP_COMMIT"
  "$PY" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.is_available() and torch.cuda.get_device_name())"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1; } > "$OUT/machine.txt" 2>&1

# install condcomp from this tree into $W/site (no network); where pip fails or its result does not import, copy
assemble() {
  rm -rf "$W/site" && mkdir -p "$W/site"
  cp -r "$ROOT/condcomp" "$W/site/condcomp"
  for d in routers policies integrations; do cp -r "$ROOT/$d" "$W/site/condcomp/$d"; done
  echo "assembled by copying condcomp/ with routers/ policies/ integrations/ inside" >> "$OUT/install.log"
}
imports() { (cd "$W/run" && "$PY" -c "import condcomp.bench.gpu_check as m; print('condcomp from', m.__file__)") \
  >> "$OUT/install.log" 2>&1; }
export PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH}
if [ "${INSTALL:-pip}" = pip ] && "$PY" -m pip install --no-deps --no-index --no-build-isolation --target "$W/site" \
    "$ROOT" > "$OUT/install.log" 2>&1 && imports; then
  echo "installed with pip --target" >> "$OUT/install.log"
else
  assemble
  imports || { echo "condcomp does not import; see $OUT/install.log"; tail -20 "$OUT/install.log"; exit 3; }
fi
cd "$W/run"  # an empty working directory: the installed package is imported, not the checkout's folder
