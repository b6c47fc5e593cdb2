"""Where the staged corpora are found ($CONDCOMP_DATA_DIR, else ../shared/data), ``CONDCOMP_DATA_DIR=none`` (a
clone's view, which CI's first test run takes), and, where the corpora are in reach, that they read as the
commands read them (tests marked ``needs_data``: CI's second run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from condcomp.experiments import data as D


def checkout_beside_data(tmp_path: Path) -> tuple[Path, Path]:
    """``(checkout, its ../shared/data)``: two folders laid out as the project's machines have them."""
    checkout, staged = tmp_path / "repo", tmp_path / "shared" / "data"
    checkout.mkdir(), staged.mkdir(parents=True)
    return checkout, staged


def test_the_data_folder_is_the_variable_then_the_one_beside_the_checkout(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    checkout, staged = checkout_beside_data(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(checkout)
    monkeypatch.delenv("CONDCOMP_DATA_DIR", raising=False)
    assert D.staged_data_dir(checkout).resolve() == staged.resolve()
    assert D.resolve_data_dir().resolve() == staged.resolve()
    monkeypatch.setenv("CONDCOMP_DATA_DIR", str(elsewhere))  # the variable wins over ../shared/data
    assert D.resolve_data_dir() == elsewhere
    assert D.resolve_data_dir(str(staged)) == staged  # --data-dir wins over both


def test_none_hides_the_staged_corpora_as_on_a_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkout, staged = checkout_beside_data(tmp_path)
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("CONDCOMP_DATA_DIR", "none")
    assert D.staged_data_dir(checkout) is None
    with pytest.raises(FileNotFoundError, match=r"CONDCOMP_DATA_DIR=none.*pass --data-dir"):
        D.resolve_data_dir()
    assert D.resolve_data_dir(str(staged)) == staged  # an explicit --data-dir still reads them


def test_bench_kv_falls_back_to_the_builtin_corpus_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from condcomp.bench.kv_text import BUILTIN, builtin_texts, choose_texts

    checkout, _ = checkout_beside_data(tmp_path)
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("CONDCOMP_DATA_DIR", "none")
    assert choose_texts(seed=3) == (builtin_texts(3), BUILTIN)
    assert "no staged corpora" in capsys.readouterr().out
    monkeypatch.delenv("CONDCOMP_DATA_DIR")
    assert choose_texts(seed=3) == (None, "staged")  # ../shared/data beside it


def test_a_variable_naming_no_folder_is_an_error_not_a_fallback(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.bench.kv_text import choose_texts

    checkout, _ = checkout_beside_data(tmp_path)
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("CONDCOMP_DATA_DIR", str(tmp_path / "typo"))
    for call in (D.staged_data_dir, D.resolve_data_dir, choose_texts):
        with pytest.raises(FileNotFoundError, match=r"CONDCOMP_DATA_DIR=.*typo: no such folder.*'none'"):
            call()


@pytest.mark.needs_data
@pytest.mark.parametrize("name", sorted(D.DATASETS))
def test_each_staged_dataset_reads_by_name(name: str) -> None:
    folder = D.staged_data_dir(Path(__file__).resolve().parents[2])
    assert folder is not None  # the marker skips otherwise
    records = D.load_named(name, folder, "test")
    assert len(records.texts) == len(records.labels) > 100
    assert all(isinstance(t, str) and t for t in records.texts) and all(isinstance(y, int) for y in records.labels)
    assert (records.pairs is not None) == (D.DATASETS[name].pair_field is not None)


@pytest.mark.needs_data
def test_bench_kv_and_calibrate_kv_read_the_staged_test_documents() -> None:
    from condcomp.bench.kv import CORPORA
    from condcomp.bench.kv_cases import corpus_texts
    from condcomp.experiments.llm.data import dataset_documents

    folder = D.staged_data_dir(Path(__file__).resolve().parents[2])
    assert folder is not None
    texts = corpus_texts(folder, CORPORA, seed=0)
    per = [dataset_documents(name, folder, "test", 0) for name in CORPORA]
    assert len(texts) == len(CORPORA) * min(len(p) for p in per) > 0
    assert texts[:len(CORPORA)] == [p[0] for p in per]  # interleaved, one document of each corpus in turn


def test_the_llm_commands_missing_data_error_offers_only_what_they_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """calibrate-kv and tune-llm have no --dataset option: their error must not suggest one (it did: a newcomer's
    clone ran calibrate-kv, was told to pass --dataset files, and argparse refused it)."""
    monkeypatch.setenv("CONDCOMP_DATA_DIR", "none")
    with pytest.raises(FileNotFoundError) as llm:
        D.resolve_data_dir(None, D.LLM_DATA_ADVICE)
    assert "--data-dir" in str(llm.value) and "--dataset files" not in str(llm.value)
    with pytest.raises(FileNotFoundError) as classification:
        D.resolve_data_dir(None)
    assert "--dataset files" in str(classification.value)
