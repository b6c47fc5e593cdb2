"""docs/api.md is generated from the docstrings (``python -m condcomp.docgen``) and must match them."""

from __future__ import annotations

import condcomp
from condcomp import docgen


def test_api_reference_is_up_to_date() -> None:
    assert docgen.main(["--check"]) == 0, "docs/api.md is stale: run python -m condcomp.docgen"


def test_api_reference_covers_every_public_name_and_component() -> None:
    text = docgen.render()
    for name in condcomp.__all__:
        assert f"### `{name}`" in text
    for key in condcomp.list_policies() + condcomp.list_routers() + condcomp.list_executors():
        assert f"### `{key}` (" in text
