"""``import condcomp`` stays light: no transformers, timm or codecarbon, no Triton kernel module of the pair ops
(condcomp/executors/gathered/pairs/), and CUDA is never initialised."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import torch
import condcomp
layer = condcomp.HeadAttention(16, 4)
routed = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(policy="full", router="random"))
routed(torch.randn(1, 3, 16))
print(json.dumps({
    "heavy": sorted(m for m in ("transformers", "timm", "codecarbon", "matplotlib",
                                "condcomp.executors.gathered.pairs.kernels", "condcomp.executors.gathered.pairs.launch")
                    if m in sys.modules),
    "cuda_initialized": torch.cuda.is_initialized(),
    "registries": [condcomp.list_policies(), condcomp.list_routers(), condcomp.list_executors()],
}))
"""


@pytest.mark.slow
def test_import_is_light_and_does_not_touch_cuda() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["heavy"] == [], f"import condcomp pulled in {facts['heavy']}"
    assert facts["cuda_initialized"] is False
    policies, routers, executors = facts["registries"]
    # the built-ins are registered by the import alone, no extra import needed
    assert {"full", "fixed"} <= set(policies) and "random" in routers and {"reference", "masked"} <= set(executors)


LAZY_PROBE = """
import json, sys
import condcomp
light = "transformers" not in sys.modules
names = {}
for path in ("integrations.hf.CondCompCallback", "integrations.hf_checkpoint.from_pretrained",
             "integrations.hf_checkpoint.save_pretrained",
             "integrations.hf.interface.apply_interface_", "integrations.hf.register_transformers_attention"):
    obj = condcomp
    for part in path.split("."):
        obj = getattr(obj, part)
    names[path] = callable(obj)
try:
    condcomp.integrations.no_such_module
    unknown = "no error"
except AttributeError as err:
    unknown = str(err)
print(json.dumps({"light": light, "names": names, "unknown": unknown}))
"""


@pytest.mark.slow
def test_integration_names_work_as_written_after_import_condcomp() -> None:
    # The README writes condcomp.integrations.hf.CondCompCallback() right after `import condcomp`.
    pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")
    out = subprocess.run([sys.executable, "-c", LAZY_PROBE], capture_output=True, text=True, timeout=300, check=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["light"] is True, "import condcomp alone must not import transformers"
    assert all(facts["names"].values()), facts["names"]
    assert "no_such_module" in facts["unknown"]
