"""Where a config error comes from: a duplicate key in the file (refused, with both lines), and
a rule broken by a `--set` (the error names that --set, not the file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT, ClusterConfigError, load_config

TINY = REPO_ROOT / "configs" / "tiny-1p1d.yaml"


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ClusterConfigError) as info:
        load_config(path, overrides or [])
    return str(info.value)


def test_a_duplicate_key_is_refused_naming_key_section_and_both_lines(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text(
        "gateway:\n"  # 1
        "  host: 127.0.0.1\n"  # 2
        "  port: 8000\n"  # 3
        "  api_key: k\n"  # 4
        "  port: 8100\n"  # 5: PyYAML would keep this one, silently
    )
    assert error_of(p) == (
        f"{p}: line 5: duplicate key 'port' in 'gateway' (the first is at line 3): keep one"
    )


@pytest.mark.parametrize(
    ("text", "where", "lines"),
    [
        ("model: {}\nmodel: {}\n", "at the top level", (2, 1)),
        ("roles:\n  prefill:\n    count: 1\n    parallel: {tp_size: 1, tp_size: 2}\n"
         "  decode: {}\n", "in 'roles.prefill.parallel'", (4, 4)),
        ("roles:\n  prefill: {}\n  decode: {}\n  prefill: {count: 2}\n", "in 'roles'", (4, 2)),
        # a list item's mapping: its index is in the path
        ("x:\n  - {a: 1}\n  - a: 1\n    a: 2\n", "in 'x[1]'", (4, 3)),
    ],
)
def test_duplicate_keys_anywhere(tmp_path: Path, text: str, where: str, lines: tuple) -> None:
    p = tmp_path / "x.yaml"
    p.write_text(text)
    msg = error_of(p)
    assert f"line {lines[0]}: duplicate key" in msg and where in msg, msg
    assert f"(the first is at line {lines[1]})" in msg and "\n" not in msg


def test_same_key_in_different_sections_and_yaml_merge_keys_are_fine(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text(
        "roles:\n"
        "  prefill: &r {count: 1, base_port: 51000}\n"
        "  decode:\n"
        "    <<: *r\n"
        "    base_port: 52000\n"
        "gateway: {port: 8001}\n"
        "transfer: {bootstrap_port: 0}\n"
    )
    c = load_config(p)
    assert c.roles.decode is not None and c.roles.decode.base_port == 52000
    assert c.gateway.port == 8001


def test_a_set_that_breaks_a_rule_is_named_not_the_file() -> None:
    msg = error_of(TINY, ["roles.decode.count=0"])
    assert msg.startswith("--set 'roles.decode.count=0': roles.decode.count must be >= 1"), msg
    assert str(TINY) not in msg
    # A cross-field rule the message words otherwise: the --set whose removal fixes it.
    msg = error_of(TINY, ["launcher.kind=local", "roles.prefill.base_port=8000"])
    assert msg.startswith("--set 'roles.prefill.base_port=8000': port collision"), msg
    # A rule two --set break together: both named.
    msg = error_of(TINY, ["gateway.api_key=k", "gateway.admin_key=k"])
    assert msg.startswith("--set 'gateway.api_key=k', --set 'gateway.admin_key=k': "), msg


def test_a_rule_the_file_breaks_still_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text("roles:\n  prefill: {count: 0}\n  decode: {}\n")
    # --set of an unrelated key: the file is to blame.
    msg = error_of(p, ["gateway.port=8100"])
    assert msg.startswith(f"{p}: roles.prefill.count must be >= 1"), msg
    # A --set that cannot fix it, on the same section: still the file.
    msg = error_of(p, ["roles.prefill.num_threads=1"])
    assert msg.startswith(f"{p}: roles.prefill.count must be >= 1"), msg


def test_a_bad_set_key_names_the_set_only() -> None:
    msg = error_of(TINY, ["roles.decode.cout=2"])
    assert msg.startswith("--set 'roles.decode.cout=2': unknown key 'cout'"), msg
