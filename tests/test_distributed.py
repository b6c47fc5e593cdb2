"""DDP and FSDP2 (fully_shard) on 2 CPU processes (gloo) launched by torchrun: parameters after a few steps
equal single-process training on the same global batch, with router parameters unused on one rank.

The worker (tests/distributed_worker.py) documents each scenario; docs/reliability.md has the flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("distributed_worker.py")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="this torch build has no torch.distributed gloo backend")
def test_ddp_and_fsdp2_match_single_process(tmp_path: Path) -> None:
    scenarios = "ddp_find_unused,ddp_touch,fsdp2,ddp_plain"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(WORKER), str(tmp_path), "gathered", scenarios]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONDCOMP_DIST_TIMEOUT": "30"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads((tmp_path / "result.json").read_text())
    assert [r["world_size"] for r in ranks] == [2, 2]
    # the data makes heads 2-3 idle on rank 0 and heads 0-1 idle on rank 1: their router parameters are unused
    assert ranks[0]["unused_heads_rank0"] == [2, 3] and ranks[1]["unused_heads_rank1"] == [0, 1]
    for r in ranks:
        for name in ("ddp_find_unused", "ddp_touch", "fsdp2"):
            assert "max_abs_diff" in r[f"gathered/{name}"], r[f"gathered/{name}"]
            assert r[f"gathered/{name}"]["max_abs_diff"] < 1e-5, (name, r[f"gathered/{name}"])
        # without find_unused_parameters, DDP refuses parameters that got no gradient, with a clear message
        assert "find_unused_parameters=True" in r["gathered/ddp_plain"]["error"]
