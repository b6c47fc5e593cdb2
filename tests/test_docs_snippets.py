"""The python snippets of docs/extending.md and docs/concepts.md run as written (the docs cannot rot)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(page: str) -> list[str]:
    return FENCE.findall((DOCS / page).read_text())


def test_extending_md_snippets_run(restore_registries: None) -> None:
    blocks = snippets("extending.md")
    assert len(blocks) >= 3, "extending.md lost its router, policy or executor example"
    router = blocks[0]
    body = router[router.index("@condcomp.register_router"):router.index("\n\n\nmodel =")]
    assert len(body.splitlines()) < 30, "the router example must stay under 30 lines"
    namespace: dict[str, object] = {"__name__": "docs_extending"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/extending.md[{i}]", "exec"), namespace)  # noqa: S102 - our own docs
    import condcomp

    assert {"example_l2"} <= set(condcomp.list_routers())
    assert {"example_length"} <= set(condcomp.list_policies())
    assert {"example_union", "example_union_costed", "example_gathered"} <= set(condcomp.list_executors())


@pytest.mark.parametrize("page", ["concepts.md"])
def test_other_pages_snippets_run(page: str) -> None:
    blocks = snippets(page)
    assert blocks, f"docs/{page} has no python example left"
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/{page}[{i}]", "exec"), {"__name__": "docs"})  # noqa: S102


def test_readme_usage_runs_and_reports_the_budget() -> None:
    # The README's example as written, with 2 training steps instead of 100 (the API is what is checked).
    import contextlib
    import io

    (code,) = FENCE.findall((DOCS.parent / "README.md").read_text())
    assert "range(100)" in code and "step / 100" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("range(100)", "range(2)"), "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
    # budgetformer starts near s = 0.6, so eval runs floor(0.6 * 8) = 4 of 8 heads: k_frac 0.5 in every layer
    assert out.getvalue().count("k_frac=0.5,") == 4, out.getvalue()
