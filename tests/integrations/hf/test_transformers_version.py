"""The oldest transformers condcomp.integrations.hf accepts: refused below it with the install line, and the same
floor as pyproject.toml's extras (5.23 and older pass the KV cache to attention as `past_key_values`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from condcomp.integrations.hf import OLDEST_TRANSFORMERS, require_transformers  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("version", ["5.23.0", "5.17.0", "5.0.0", "4.57.6", "6.0.0", "dev"])
def test_an_unsupported_transformers_is_refused_with_the_install_line(version: str) -> None:
    with pytest.raises(ImportError, match=r"transformers>=5\.24,<6"):
        require_transformers(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.25.0", "5.30.1.dev0"])
def test_a_supported_transformers_is_accepted(version: str) -> None:
    require_transformers(version)


def test_every_extra_that_installs_transformers_names_the_same_floor() -> None:
    pins = re.findall(r'"(transformers\b[^"]*)"', (ROOT / "pyproject.toml").read_text())  # tomllib is 3.11+
    assert len(pins) >= 3  # hf, llm, examples
    assert set(pins) == {f"transformers>={OLDEST_TRANSFORMERS[0]}.{OLDEST_TRANSFORMERS[1]},<6"}


def test_without_transformers_import_condcomp_works_and_the_integration_names_the_install_line() -> None:
    # a fresh interpreter where transformers cannot be imported (None in sys.modules blocks the import)
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None\n"
            "import torch, condcomp\n"
            "m = torch.nn.Sequential(condcomp.HeadAttention(16, 4))\n"
            "condcomp.apply_(m, condcomp.CondCompConfig(policy=('fixed', {'fraction': 0.5})))\n"
            "assert m(torch.randn(1, 3, 16)).shape == (1, 3, 16)\n"
            "try:\n"
            "    import condcomp.integrations.hf\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "transformers>=5.24,<6" in out.stdout and "not installed" in out.stdout, out.stdout
