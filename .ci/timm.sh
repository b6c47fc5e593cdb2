#!/usr/bin/env bash
# timm tests in their own virtual environment (called by .ci/run; safe to run by hand from the repo root).
#
# Why a second venv: timm imports torchvision at import time, and the PyPI torchvision wheels need the torch they
# were built against (torchvision 0.28 beside the CPU torch 2.13 wheel fails with "operator torchvision::nms does
# not exist"). torch 2.14.1 + torchvision 0.29.1 install from this machine's local package index (a CUDA build
# that runs on the CPU). Measured cost: ~2 min and ~5.6 GB on the first run; seconds after.
# Idempotent: an existing venv that already imports timm is reused; only condcomp is re-installed (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CONDCOMP_TIMM_VENV:-/tmp/condcomp-timm-venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
start=$(date +%s)
if ! "$VENV/bin/python" -c "import timm, torchvision, pytest, hypothesis" >/dev/null 2>&1; then
    echo "timm.sh: creating $VENV with $PY"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1 timm pytest hypothesis einops \
        typing-extensions numpy 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -c "import timm, torchvision" # fail here, clearly, if the install did not work
    echo "timm.sh: created in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) in $VENV"
fi
"$VENV/bin/pip" install -q --no-deps -e . 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
echo "timm.sh: environment ready in $(( $(date +%s) - start )) s"
"$VENV/bin/python" -m pytest tests/integrations/test_timm_adapter.py -q -p no:cacheprovider "$@"
