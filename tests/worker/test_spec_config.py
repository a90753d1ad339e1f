"""A drafter named for the wrong method says which method it is for.

A newcomer who points `speculative.model` at the embedded model's `mtp/` with
`speculative.method=draft`, or sets `speculative.model` and forgets `speculative.method`, gets
one line naming the field and the fix (the method that drafter needs), not a list of target
architectures or "train one". The checks run without torch, before any process starts
(worker/arch/drafter.py, worker/config.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.launch.background import EMBEDDED_MODEL
from worker.arch.drafter import check_drafter
from worker.arch.load import load_arch_config
from worker.config import ConfigError, SpeculativeConfig

TARGET = Path(EMBEDDED_MODEL)


@pytest.mark.parametrize(("method", "drafter", "fix"), [
    ("draft", "eagle", "speculative.method=eagle"),
    ("draft", "mtp", "speculative.method=mtp"),
    ("eagle", "mtp", "speculative.method=mtp"),
    ("mtp", "eagle", "speculative.method=eagle"),
    ("eagle", "draft", "speculative.method=draft"),
    ("mtp", "draft", "speculative.method=draft"),
])
def test_a_drafter_for_another_method_names_that_method(method: str, drafter: str,
                                                         fix: str) -> None:
    with pytest.raises(ConfigError, match=fix) as err:
        check_drafter(method, load_arch_config(TARGET), TARGET, TARGET / drafter, 512)
    assert "speculative.model" in str(err.value) and "\n" not in str(err.value)


def test_the_right_drafters_pass() -> None:
    for method in ("draft", "eagle", "mtp"):
        check_drafter(method, load_arch_config(TARGET), TARGET, TARGET / method, 512)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_a_drafter_model_without_its_method_names_the_methods(method: str) -> None:
    with pytest.raises(ConfigError, match="speculative.method") as err:
        SpeculativeConfig(method=method, model="models/tandem-arith/eagle").validate()
    assert "draft | eagle | mtp" in str(err.value) and "unset speculative.model" in str(err.value)


def test_a_worker_says_in_its_log_that_it_drafts(caplog: pytest.LogCaptureFixture) -> None:
    # The ready line and /workers do not show it, and /metrics only once a draft is verified.
    from tests.worker.test_spec import _engine

    with caplog.at_level("INFO"):
        _engine("eagle", k=3)
    text = caplog.text
    assert "speculative decoding: eagle, up to 3 drafts a step" in text
    assert f"drafter {TARGET / 'eagle'} (eagle:1:" in text
    caplog.clear()
    with caplog.at_level("INFO"):
        _engine("ngram", k=5)
    assert "speculative decoding: ngram (n-grams of 1-4 tokens), up to 5 drafts" in caplog.text


def test_a_drafter_beside_a_checkpoint_with_its_own_mtp_layer_is_refused(tmp_path: Path) -> None:
    # mtp runs the checkpoint's own layer: a speculative.model set beside it would be ignored
    # silently (the user's module never drafts), so it is refused naming the field.
    from tests.worker.deepseek_model import build_deepseek_checkpoint

    target = tmp_path / "deepseek"
    build_deepseek_checkpoint(target, mtp=True, num_nextn_predict_layers=1)
    arch = load_arch_config(target)
    check_drafter("mtp", arch, target, target / "mtp", 512)  # the default: the own layer
    with pytest.raises(ConfigError, match="unset speculative.model") as err:
        check_drafter("mtp", arch, target, TARGET / "mtp", 512)
    assert "speculative.model" in str(err.value) and "\n" not in str(err.value)


def test_refusals_offer_only_methods_the_target_runs(tmp_path: Path) -> None:
    # mtp on a checkpoint without MTP layers suggests the other methods; eagle is only for the
    # dense families (a gpt-oss target refuses it), a draft model not for MLA targets.
    from tests.worker.deepseek_model import build_deepseek_checkpoint
    from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint

    gpt_oss, deepseek = tmp_path / "gpt-oss", tmp_path / "deepseek"
    build_gpt_oss_checkpoint(gpt_oss)
    build_deepseek_checkpoint(deepseek)
    with pytest.raises(ConfigError, match="speculative.method draft or ngram$"):
        check_drafter("mtp", load_arch_config(gpt_oss), gpt_oss, gpt_oss / "mtp", 512)
    with pytest.raises(ConfigError, match="speculative.method eagle, draft or ngram$"):
        check_drafter("mtp", load_arch_config(TARGET), TARGET, tmp_path / "none", 512)
    # A DeepSeek-V3 directory as a Llama target's draft model: it names what it is instead.
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM is not a dense Llama / Qwen"):
        check_drafter("draft", load_arch_config(TARGET), TARGET, deepseek, 512)
    with pytest.raises(ConfigError, match="GptOssForCausalLM is not a dense Llama / Qwen"):
        check_drafter("draft", load_arch_config(TARGET), TARGET, gpt_oss, 512)


def test_a_worker_given_mtp_without_the_mtp_weights_names_what_it_can_run(tmp_path: Path) -> None:
    # A worker started by hand (no launcher preflight) refuses in the same line.
    from tests.worker.deepseek_model import build_deepseek_checkpoint
    from worker.config import ModelConfig, WorkerConfig
    from worker.engine import Engine

    model = tmp_path / "deepseek"
    build_deepseek_checkpoint(model, num_nextn_predict_layers=1)
    config = WorkerConfig(model=ModelConfig(path=str(model), dtype="float32"),
                          speculative=SpeculativeConfig(method="mtp"))
    says = r"model\.layers\.3\.\* tensors .*speculative\.method ngram$"
    with pytest.raises(ConfigError, match=says):
        Engine(config)


@pytest.mark.parametrize(("sets", "field"), [
    ({"num_speculative_tokens": 5}, "speculative.num_speculative_tokens"),
    ({"method": "eagle", "ngram_max": 6}, "speculative.ngram_max"),
    ({"method": "draft", "ngram_min": 2}, "speculative.ngram_min"),
])
def test_a_knob_the_method_does_not_read_is_refused(sets: dict[str, object], field: str) -> None:
    # vLLM refuses num_speculative_tokens without a drafter; here it was dropped silently and the
    # worker served with no speculation (the ready line just did not mention it).
    with pytest.raises(ConfigError, match=field) as err:
        SpeculativeConfig(**sets).validate()  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
    SpeculativeConfig(method="ngram", num_speculative_tokens=5, ngram_max=6).validate()
