"""The study page's per-dataset arm table: its "seeds" column counts the arm's seeds (as the summary's column
does), not lists their numbers: one seed numbered 0 reads 1, seeds 0 and 3 read 2."""

from __future__ import annotations

from pathlib import Path

from condcomp.experiments.classification.study_page_sections import per_dataset_section


def test_the_seeds_column_counts_seeds(tmp_path: Path) -> None:
    records = [{"dataset": "ag_news", "arm": "standard", "seed": 0},
               {"dataset": "ag_news", "arm": "budgetformer", "seed": 0},
               {"dataset": "ag_news", "arm": "budgetformer", "seed": 3}]
    lines = per_dataset_section(records, {}, ["ag_news"], tmp_path, str, plots=False)
    header = next(i for i, line in enumerate(lines) if line.startswith("| arm | seeds |"))
    cells = [line.split(" | ") for line in lines[header + 2:] if line.startswith("|")]
    rows = {c[0].strip("| "): c[1] for c in cells}
    assert rows == {"standard": "1", "budgetformer": "2"}
