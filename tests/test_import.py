"""``import condcomp`` stays light: no transformers, timm or codecarbon, and CUDA is never initialised."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import torch
import condcomp
layer = condcomp.HeadAttention(16, 4)
routed = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(policy="full", router="random"))
routed(torch.randn(1, 3, 16))
print(json.dumps({
    "heavy": sorted(m for m in ("transformers", "timm", "codecarbon", "matplotlib") if m in sys.modules),
    "cuda_initialized": torch.cuda.is_initialized(),
    "registries": [condcomp.list_policies(), condcomp.list_routers(), condcomp.list_executors()],
}))
"""


def test_import_is_light_and_does_not_touch_cuda() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["heavy"] == [], f"import condcomp pulled in {facts['heavy']}"
    assert facts["cuda_initialized"] is False
    policies, routers, executors = facts["registries"]
    # the built-ins are registered by the import alone, no extra import needed
    assert {"full", "fixed"} <= set(policies) and "random" in routers and {"reference", "masked"} <= set(executors)
