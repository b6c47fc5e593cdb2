"""``condcomp bench decode --quick`` on the tiny random Llama: every variant timed and written, the full budget's
greedy tokens equal the dense model's (reference: the dense model's own tokens), the KV cache measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from condcomp.cli import main

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")


@pytest.mark.slow
def test_quick_decode_benchmark_writes_every_variant(tmp_path: Path) -> None:
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "metrics.json").read_text())["records"]
    by = {r["variant"]: r for r in records}
    assert list(by) == ["dense", "full", "keep_0.50", "keep_0.25"]
    assert by["dense"]["tokens_equal_dense"] and by["full"]["tokens_equal_dense"]
    # (B=2) x (prompt 16 + 3 decoded tokens) x 4 layers x 8 KV heads x 64 dims x (K and V) x 4 bytes
    assert by["dense"]["kv_bytes"] == 2 * 19 * 4 * 8 * 64 * 2 * 4 and by["full"]["kv_ratio"] == 1.0
    # per-request plans cache the kept KV heads only: 4 and 2 of 8 (both rows keep the same number)
    assert by["keep_0.50"]["kv_ratio"] == 0.5 and by["keep_0.25"]["kv_ratio"] == 0.25
    assert (tmp_path / "table.md").read_text().startswith("| prompt |")


@pytest.mark.slow
def test_moh_and_chosen_variants_decode_with_a_full_cache_and_unknown_names_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MoH routes per token: a later token may pick any head, so every key/value head stays cached."""
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--out", str(tmp_path),
                 "--variants", "moh_0.5", "keep_0.125", "stream_0.25"]) == 0
    by = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert list(by) == ["dense", "moh_0.5", "keep_0.125", "stream_0.25"]  # dense always runs: the ratios' baseline
    # streaming the unkept groups: a 4 + 252-token window holds the whole short request, so every head attends
    # what the dense model's does (same greedy tokens) and every head is computed
    assert by["stream_0.25"]["tokens_equal_dense"] and by["stream_0.25"]["k_frac"] == 1.0
    assert by["moh_0.5"]["kv_ratio"] == 1.0 and by["keep_0.125"]["kv_ratio"] == 0.125
    # heads per decode token: MoH 2 shared + top-2 of 6 = 4 of 8; keeping 1 of 8 KV heads (MHA) = 1 of 8
    assert by["moh_0.5"]["k_frac"] == 0.5 and by["keep_0.125"]["k_frac"] == 0.125 and by["dense"]["k_frac"] == 1.0
    for bad in ("keep_2", "moh", "stream_0", "sparse_0.5", "keep_0.2_5", "keep_0.5 keep_0.50"):
        assert main(["bench", "decode", "--model", "smollm2", "--quick", "--out", str(tmp_path / "x"),
                     "--variants", *bad.split()]) != 0  # refused before the model loads (smollm2 may be absent)
        err = capsys.readouterr().err
        assert f"unknown decode variant {bad!r}" in err or "one variant twice" in err


@pytest.mark.slow
def test_compiled_decode_benchmark_runs_each_variant_eager_and_compiled_on_a_static_cache(tmp_path: Path) -> None:
    """``--compile --compile-backend eager``: the capture alone (no inductor build), as on a CPU-only CI."""
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--compile", "--compile-backend", "eager",
                 "--variants", "full", "keep_0.25", "--out", str(tmp_path)]) == 0
    by = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert list(by) == ["dense", "full", "keep_0.25", "dense+compiled", "full+compiled", "keep_0.25+compiled"]
    for name, r in by.items():
        assert r["cache"] == "static" and r["compiled"] == name.endswith("+compiled")
        if r["compiled"]:  # the warm-up compiles once; a Python counter guarded per step would compile every step
            assert r["compiles"] == 1 and r["tokens_equal_eager"], name
    assert by["full+compiled"]["tokens_equal_dense"] and by["full"]["tokens_equal_dense"]
    # static caches of prompt 16 + 4 tokens: (B=2) x 20 x 64 dims x (K and V) x 4 bytes per head, + the int64
    # token count, per layer (4): 8 heads dense, 2 kept of 8 at keep_0.25
    per_head, count = 2 * 20 * 64 * 2 * 4, 8
    assert by["dense+compiled"]["kv_bytes"] == 4 * (8 * per_head + count)
    assert by["keep_0.25+compiled"]["kv_bytes"] == 4 * (2 * per_head + count)
    assert "| compiles |" in (tmp_path / "table.md").read_text()


@pytest.mark.slow
def test_compiled_decode_benchmark_runs_a_window_split_compiled(tmp_path: Path) -> None:
    """``stream_0.25`` (a quarter of the groups in full, the others a window of 4 + 252 tokens, as the DuoAttention
    split) decodes compiled on the static cache: the window's slots preallocated at prefill, one compilation."""
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--compile", "--compile-backend", "eager",
                 "--variants", "stream_0.25", "--out", str(tmp_path)]) == 0
    by = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert list(by) == ["dense", "stream_0.25", "dense+compiled", "stream_0.25+compiled"]
    run = by["stream_0.25+compiled"]
    assert run["compiles"] == 1 and run["tokens_equal_eager"]
    # per layer (4): 2 of 8 groups in the static layer, (B=2) x 20 positions x 64 dims x (K and V) x 4 bytes each,
    # + its int64 count; the 6 others in a ring of min(4 + 252, 20) slots (a request never holds more than the
    # static cache's 20 tokens) + the int64 tokens seen per row and valid slots per (row, group)
    per_head = 2 * 20 * 64 * 2 * 4
    assert run["kv_bytes"] == 4 * (2 * per_head + 8 + 6 * per_head + 2 * 8 + 2 * 6 * 8)


@pytest.mark.slow
def test_a_kernel_variant_decodes_through_the_split_k_kernel_eager_and_compiled(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``keep_<f>+kernel``: the same plans with ``decode_kernel=True`` (the op's torch fallback on a CPU, the Triton
    kernels under ``TRITON_INTERPRET=1``): compiled once, its compiled tokens equal to its eager ones."""
    import importlib.util

    from condcomp.kv.kernels import fallback

    ran = []
    modules = [fallback] + ([importlib.import_module("condcomp.kv.kernels.launch")]
                            if importlib.util.find_spec("triton") else [])
    for module in modules:
        def counted(*args: object, _run: Any = module.decode_attention) -> Any:
            ran.append(1)
            return _run(*args)

        monkeypatch.setattr(module, "decode_attention", counted)
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--compile", "--compile-backend", "eager",
                 "--variants", "keep_0.25", "keep_0.25+kernel", "--out", str(tmp_path)]) == 0
    by = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert list(by) == ["dense", "keep_0.25", "keep_0.25+kernel", "dense+compiled", "keep_0.25+compiled",
                        "keep_0.25+kernel+compiled"]
    assert by["keep_0.25+kernel+compiled"]["compiles"] == 1 and by["keep_0.25+kernel+compiled"]["tokens_equal_eager"]
    assert by["keep_0.25+kernel"]["kv_bytes"] == by["keep_0.25"]["kv_bytes"]
    assert ran, "the kernel variant never reached the decode attention op"
    for bad in ("dense+kernel", "moh_0.5+kernel"):
        assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--compile", "--out", str(tmp_path / "x"),
                     "--variants", bad]) != 0
        assert "applies to condcomp's compact cache" in capsys.readouterr().err
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--out", str(tmp_path / "x"),
                 "--variants", "keep_0.25+kernel"]) != 0
    assert "add --compile" in capsys.readouterr().err


@pytest.mark.slow
def test_dtype_casts_every_variant_and_its_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--dtype", "bfloat16", "--out", str(tmp_path),
                 "--variants", "keep_0.25"]) == 0
    by = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert {r["dtype"] for r in by.values()} == {"bfloat16"}
    # the float32 count of test_quick_decode_benchmark_writes_every_variant, at 2 bytes a value
    assert by["dense"]["kv_bytes"] == 2 * 19 * 4 * 8 * 64 * 2 * 2 and by["keep_0.25"]["kv_ratio"] == 0.25
    with pytest.raises(SystemExit):
        main(["bench", "decode", "--model", "tiny-llama", "--quick", "--dtype", "fp8", "--out", str(tmp_path / "x")])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
