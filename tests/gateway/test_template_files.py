"""Where a checkpoint keeps its chat template, read as transformers reads it (compared with
transformers' own `apply_chat_template` on the same directory):

- `tokenizer_config.json` `chat_template` as a list of named templates (Hermes-2-Pro and
  Command-R ship "default" and "tool_use"): a request with tools renders "tool_use", one
  without renders "default"; the tools check and parser detection see the tool template;
- `chat_template.jinja` beside a `chat_template` in the config: the file wins;
- `additional_chat_templates/NAME.jinja`: named templates as well.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gateway.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

DEFAULT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_USE = ("<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} "
            "{% endfor %}<tool_call></tool_call><|im_end|>\n" + DEFAULT)
FILE = "file: " + DEFAULT
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "d",
                                           "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "héllo 🙂"}]


def _dir(tok_dir: Path, out: Path, template: Any, files: dict[str, str]) -> Path:
    shutil.copy(tok_dir / "tokenizer.json", out / "tokenizer.json")
    cfg = {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, text in files.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    return out


NAMED = [{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE}]
CASES = {
    "named": (NAMED, {}),
    "jinja_beside_config": (DEFAULT, {"chat_template.jinja": FILE}),
    "additional_files": (None, {"chat_template.jinja": DEFAULT,
                                "additional_chat_templates/tool_use.jinja": TOOL_USE}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_template_transformers_renders(case: str, tok_dir: Path, tmp_path: Path) -> None:
    path = _dir(tok_dir, tmp_path, *CASES[case])
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    ours = Tokenizer.from_dir(path)
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True,
                                      tokenize=False)
        assert ours.render_chat(MESSAGES, tools=tools) == want, (case, tools)
    if case != "jinja_beside_config":
        assert "tools" in ours.template_vars and "<tool_call>" in ours.template_source


@pytest.mark.parametrize("where", ["config", "file"])
def test_a_broken_named_template_is_one_line_naming_its_file(where: str, tok_dir: Path,
                                                             tmp_path: Path) -> None:
    from gateway.tokenizer import TokenizerLoadError

    broken = "{% for m in messages %}"
    if where == "config":
        path = _dir(tok_dir, tmp_path, [NAMED[0], {"name": "tool_use", "template": broken}], {})
        named = "tokenizer_config.json: its chat_template 'tool_use' is not a valid Jinja"
    else:
        path = _dir(tok_dir, tmp_path, None, {"chat_template.jinja": DEFAULT,
                                              "additional_chat_templates/tool_use.jinja": broken})
        named = "additional_chat_templates/tool_use.jinja: its chat_template is not a valid Jinja"
    with pytest.raises(TokenizerLoadError, match=named) as err:
        Tokenizer.from_dir(path)
    assert "\n" not in str(err.value)
