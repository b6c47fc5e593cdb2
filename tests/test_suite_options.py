"""The suite's own switches: ``pytest`` leaves the tests marked slow out, ``--full`` (what CI runs) and ``-m`` or a
test's node id bring them back; the README's test command is the one CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLOW_TEST = "tests/test_determinism.py::test_eval_is_bit_identical_across_processes"  # marked slow


def collected(*runs: list[str]) -> list[str]:
    """What ``pytest --co -q ARGS`` lists, for each run's ARGS; the runs are separate processes started together."""
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in runs]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
        outs.append(out)
    return outs


@pytest.mark.slow  # four pytest processes: a minute and more on a busy machine
def test_slow_tests_are_deselected_unless_full_or_named() -> None:
    fast, full, named, marked = collected(["tests/test_determinism.py"], ["tests/test_determinism.py", "--full"],
                                          [SLOW_TEST], ["tests/test_determinism.py", "-m", "slow"])
    assert SLOW_TEST not in fast and re.search(r"\b\d+ deselected\b", fast)
    assert SLOW_TEST in full and "deselected" not in full
    assert SLOW_TEST in named  # named by its node id: it runs
    assert SLOW_TEST in marked


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme[:readme.index("## Install")], re.S)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    after = ci.index(next(line for line in ci if "(Quickstart, second command)" in line))
    # as a clone runs it: the staged corpora beside CI's checkout out of reach (CONDCOMP_DATA_DIR=none)
    assert ci[after + 1].strip() == blocks[1].strip().replace(".venv/bin/pytest", "CONDCOMP_DATA_DIR=none "
                                                              ".venv/bin/pytest")
    assert re.search(r"\.venv/bin/pytest -q --full( |$)", blocks[1].strip())  # CI runs the whole suite
    assert ".venv/bin/pytest -q -m needs_data" in [line.strip() for line in ci[after + 2:]]  # then those, in reach
