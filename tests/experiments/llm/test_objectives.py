"""``condcomp tune-llm --objective``: the distillation losses against independent float64 computations on a tiny
random Llama (no download), zero loss when the student is the teacher, the teacher being the loaded model untouched
by tuning, the objective in each record, and resumes that would mix two objectives refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from condcomp.experiments.llm.objectives import kl_per_token, objective_key, objective_loss
from condcomp.experiments.llm.tuning import TuneSettings, make_trainable, tune

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

VOCAB = 97


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def ids(B: int = 3, T: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _log_softmax_by_hand(row: torch.Tensor) -> torch.Tensor:
    return row - torch.logsumexp(row, 0)


# ------------------------------------------------------------------------------------------------------ losses
@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_kl_loss_equals_an_independent_float64_computation(tau: float) -> None:
    student, teacher = tiny_llama(0, torch.float64), tiny_llama(1, torch.float64)
    x, P = ids(), 5
    loss, parts = objective_loss(student, teacher, x, P, "kl", tau)
    with torch.no_grad():  # every position, the plain way
        s_logits, t_logits = student(input_ids=x).logits, teacher(input_ids=x).logits
    kl, nll = [], []
    for b in range(x.shape[0]):
        for t in range(P, x.shape[1]):  # token t is predicted at position t - 1
            log_q = _log_softmax_by_hand(s_logits[b, t - 1] / tau)
            log_p = _log_softmax_by_hand(t_logits[b, t - 1] / tau)
            kl.append(float((log_p.exp() * (log_p - log_q)).sum()))
            nll.append(float(-_log_softmax_by_hand(s_logits[b, t - 1])[x[b, t]]))
    assert loss.dtype == torch.float64 and loss.requires_grad
    assert float(loss) == pytest.approx(tau ** 2 * sum(kl) / len(kl), rel=1e-10)
    assert parts["kl"] == pytest.approx(float(loss), rel=1e-12)
    assert parts["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-10)  # the student's lm loss, for the history
    mixed, _ = objective_loss(student, teacher, x, P, "lm+kl", tau, weight=0.3)
    assert float(mixed) == pytest.approx(0.7 * sum(nll) / len(nll) + 0.3 * tau ** 2 * sum(kl) / len(kl), rel=1e-10)


def test_hidden_loss_is_the_mean_squared_error_of_the_final_hidden_states() -> None:
    student, teacher = tiny_llama(0, torch.float64), tiny_llama(1, torch.float64)
    x, P = ids(), 5
    loss, parts = objective_loss(student, teacher, x, P, "hidden")
    with torch.no_grad():  # the base models' outputs: after the final norm, before the vocabulary projection
        hs, ht = student.model(input_ids=x).last_hidden_state, teacher.model(input_ids=x).last_hidden_state
    want = sum(float(((hs[b, t - 1] - ht[b, t - 1]) ** 2).mean()) for b in range(3) for t in range(P, 12)) / (3 * 7)
    assert float(loss) == pytest.approx(want, rel=1e-10) and set(parts) == {"hidden_mse"}


def test_kl_and_hidden_are_zero_when_the_student_is_the_teacher() -> None:
    pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
    teacher = tiny_llama()
    student = make_trainable(copy.deepcopy(teacher), SETTINGS)  # LoRA starts at B = 0: the same function
    x = ids()
    for objective in ("kl", "hidden"):
        loss, _ = objective_loss(student, teacher, x, 5, objective, 2.0)
        assert abs(float(loss)) < 1e-6, objective
    same = torch.randn(2, 3, VOCAB, dtype=torch.float64)
    assert float(kl_per_token(same, same, 0.5).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="untouched dense model"):
        objective_loss(student, student, x, 5, "kl")


# ----------------------------------------------------------------------------------------- settings and resume
SETTINGS = TuneSettings(seq_len=12, prompt_len=4, batch_size=2, steps=4, warmup=1, lora_rank=2, eval_seqs=1,
                        checkpoint_every=1, lr=1e-2)


def _with(**changes: Any) -> TuneSettings:
    return TuneSettings(**{**SETTINGS.__dict__, **changes})


def test_options_are_checked_and_unused_ones_do_not_enter_the_key() -> None:
    from condcomp.experiments.llm.tuning_study import same_settings

    with pytest.raises(ValueError, match="objective must be one of lm, kl, hidden, lm\\+kl"):
        _with(objective="kd")
    with pytest.raises(ValueError, match=r"kl_temperature .* must be a finite number > 0"):
        _with(objective="kl", kl_temperature=0.0)
    with pytest.raises(ValueError, match=r"kl_weight .* >= 0 and <= 1"):
        _with(objective="lm+kl", kl_weight=1.5)
    # lm checkpoints and records written before objectives existed carry none of their fields: they still match
    assert "objective" not in SETTINGS.tuning_key() and _with(kl_temperature=3.0).tuning_key() == SETTINGS.tuning_key()
    old = {k: v for k, v in SETTINGS.__dict__.items() if k not in ("objective", "kl_temperature", "kl_weight")}
    assert same_settings(old | {"datasets": list(SETTINGS.datasets)}, SETTINGS)
    assert not same_settings(old | {"datasets": list(SETTINGS.datasets)}, _with(objective="kl"))
    assert _with(objective="kl", kl_weight=0.9).tuning_key() == SETTINGS.tuning_key() | objective_key("kl", 1.0, 0.0)


def _lora(seed: int) -> Any:
    pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
    model = tiny_llama()
    torch.manual_seed(seed)
    return make_trainable(model, SETTINGS)


def test_a_checkpoint_tuned_with_another_objective_is_refused(tmp_path: Path) -> None:
    data, teacher = ids(B=6, T=12, seed=3), tiny_llama()
    kl = _with(objective="kl")
    state = tune(_lora(7), data, kl, tmp_path / "kl.pt", stop_after=1, teacher=teacher)
    assert set(state["history"][0]) == {"step", "loss", "aux", "kl", "nll"}
    with pytest.raises(ValueError, match="tuned with the kl objective, this run asks for lm"):
        tune(_lora(7), data, SETTINGS, tmp_path / "kl.pt")
    tune(_lora(7), data, SETTINGS, tmp_path / "lm.pt", stop_after=1)
    with pytest.raises(ValueError, match="tuned with the lm objective, this run asks for kl"):
        tune(_lora(7), data, kl, tmp_path / "lm.pt", teacher=teacher)
    with pytest.raises(ValueError, match="other settings"):  # the same objective at another temperature
        tune(_lora(7), data, _with(objective="kl", kl_temperature=2.0), tmp_path / "kl.pt", teacher=teacher)
    with pytest.raises(ValueError, match="needs the teacher"):
        tune(_lora(7), data, kl, tmp_path / "none.pt")
    assert tune(_lora(7), data, kl, tmp_path / "kl.pt", teacher=teacher)["step"] == SETTINGS.steps  # resumes


# ------------------------------------------------------------------------------------------------ end to end
def test_the_study_distils_from_the_loaded_model_untouched_and_records_the_objective(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
    from test_tune_llm import CharTokenizer, staged  # the study test's stand-ins (this folder is on sys.path)

    from condcomp.experiments.llm import tuning_study

    data = staged(tmp_path / "data")
    s = TuneSettings(seq_len=16, prompt_len=6, batch_size=2, steps=2, warmup=1, lora_rank=2, eval_seqs=2,
                     calib_seqs=1, agree_prompts=2, agree_tokens=3, checkpoint_every=1, datasets=("ag_news", "yelp"),
                     objective="kl", kl_temperature=2.0)
    teachers: list[Any] = []
    real_tune = tuning_study.tune

    def spy(*args: Any, **kwargs: Any) -> Any:
        teachers.append(kwargs["teacher"])
        return real_tune(*args, **kwargs)

    monkeypatch.setattr(tuning_study, "tune", spy)
    tuning_study.run_tuning_study(s, ["static_1of3"], tmp_path / "out", tmp_path / "results", data, "cmd",
                                  lambda: (tiny_llama(), CharTokenizer()))
    record = json.loads((tmp_path / "results" / "static_1of3" / "metrics.json").read_text())
    assert record["status"] == "done", record.get("traceback")
    assert record["settings"]["objective"] == "kl" and record["settings"]["kl_temperature"] == 2.0
    assert record["tuning"]["objective"] == {"objective": "kl", "kl_temperature": 2.0}
    assert all({"kl", "nll"} <= set(h) for h in record["tuning"]["history"])
    (teacher,) = teachers
    x = ids(B=2, T=16, seed=5)
    with torch.no_grad():  # after the tuning: the teacher is still the model as loaded, unwrapped and un-LoRA'd
        torch.testing.assert_close(teacher(input_ids=x).logits, tiny_llama()(input_ids=x).logits, rtol=0, atol=0)
    assert not any("lora" in n or "condcomp" in n for n, _ in teacher.named_parameters())


def test_the_command_line_sets_the_objective_and_keeps_the_short_presets_former_name() -> None:
    from condcomp.cli import build_parser
    from condcomp.experiments.llm.command import settings_from_args

    parse = build_parser().parse_args
    s = settings_from_args(parse(["tune-llm", "--preset", "session", "--objective", "lm+kl", "--kl-temperature", "2",
                                  "--kl-weight", "0.25"]))
    assert (s.steps, s.objective, s.kl_temperature, s.kl_weight) == (40, "lm+kl", 2.0, 0.25)
    assert settings_from_args(parse(["tune-llm", "--preset", "short"])) == TuneSettings(
        steps=40, warmup=4, eval_seqs=8, calib_seqs=4, checkpoint_every=5)
    assert settings_from_args(parse(["tune-llm"])).objective == "lm"
    with pytest.raises(SystemExit):
        parse(["tune-llm", "--objective", "kd"])
