"""A follow-up analysis (results/<study>/README_*.md) can mark a summary that the study's generated page quotes."""

from __future__ import annotations

from pathlib import Path

import pytest

from condcomp.experiments.classification.study_page import FOLLOWUP_SUMMARY, followup_summary


def test_the_marked_text_is_quoted_and_nothing_else(tmp_path: Path) -> None:
    begin, end = FOLLOWUP_SUMMARY
    f = tmp_path / "README_x.md"
    f.write_text(f"# title\n\nbefore\n{begin}\n**Answer.** +0.84 [+0.67, +1.00].\n{end}\nafter\n")
    assert followup_summary(f) == "**Answer.** +0.84 [+0.67, +1.00]."


def test_no_marker_quotes_nothing(tmp_path: Path) -> None:
    f = tmp_path / "README_x.md"
    f.write_text("# title\n\njust a table\n")
    assert followup_summary(f) == ""


def test_an_unclosed_summary_says_what_to_fix(tmp_path: Path) -> None:
    f = tmp_path / "README_x.md"
    f.write_text(f"# title\n{FOLLOWUP_SUMMARY[0]}\nnever closed\n")
    with pytest.raises(ValueError, match="close the summary"):
        followup_summary(f)
