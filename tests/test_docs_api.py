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


def test_api_reference_covers_the_integration_api_and_puts_options_before_internals() -> None:
    text = docgen.render()
    for module, name in docgen.INTEGRATIONS:
        assert f"### `{module}.{name}`" in text
    for name in ("CondCompCallback", "hf.checkpoint.from_pretrained", "hf.checkpoint.save_pretrained", "load_smollm2",
                 "apply_interface_", "register_transformers_attention", "RoutedAttention.held_plan"):
        assert name in text, name
    # what a user looks for first: configuring and wrapping, then every component's options, then internals
    order = [text.index(h) for h in ("### `CondCompConfig`", "### `apply_`", "## Registered budget policies",
                                     "## Registered routers", "## Integrations", "## List and extend",
                                     "## Data types")]
    assert order == sorted(order)
