"""`scheduler.overlap: on` / `off`, as docs/config.md spells them: YAML 1.1 reads bare on/off
as booleans, so the documented values were refused ("must be one of auto | on | off, got
True.") in a config file and through --set; only a quoted "on" passed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import ClusterConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
MONO = REPO / "configs" / "tiny-mono.yaml"


@pytest.mark.parametrize("word", ["on", "off", "auto", '"on"', "On", "OFF"])
def test_overlap_takes_on_and_off_bare(word: str) -> None:
    want = word.strip('"').lower()
    assert load_config(MONO, [f"scheduler.overlap={word}"]).scheduler.overlap == want


def test_overlap_on_in_a_yaml_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("roles:\n  both:\n    count: 1\nscheduler:\n  overlap: off\n")
    assert load_config(cfg, []).scheduler.overlap == "off"


def test_a_boolean_for_a_choice_without_on_off_is_still_refused() -> None:
    with pytest.raises(ClusterConfigError, match=r"transfer\.backend: must be one of mooncake"):
        load_config(REPO / "configs" / "tiny-1p1d.yaml", ["transfer.backend=yes"])


@pytest.mark.parametrize("sets, says", [
    (["scheduler.overlap=on", "speculative.method=ngram"],
     "scheduler.overlap=on cannot run with speculative decoding"),
    (["roles.both.scheduler.overlap=on", "roles.both.parallel.tp_size=2"],
     "roles.both.scheduler.overlap=on needs a single-rank worker"),
])
def test_overlap_on_where_it_cannot_run_is_refused_at_load(
        sets: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The worker's own rule (SchedulerConfig.check_overlap), read before anything starts."""
    with pytest.raises(ClusterConfigError, match=re.escape(says)):
        load_config(MONO, sets)
    assert main(["plan", "--config", str(MONO), *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
