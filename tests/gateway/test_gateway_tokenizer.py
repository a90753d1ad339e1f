"""The gateway's tokenizer and chat template agree with transformers on a saved tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import BadRequest
from gateway.tokenizer import Tokenizer, TokenizerLoadError

# A Qwen-style template: optional system turn, role check through raise_exception, bos_token.
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    [{"role": "user", "content": "hello wörld 🙂"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a+b=c"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "日本語"}],
]


@pytest.fixture(scope="module")
def hf_dir(tok_dir, tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"),
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>")
    hf.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_matches_transformers(hf_dir, messages):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ours = Tokenizer.from_dir(hf_dir)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    assert ours.encode_chat(messages) == list(expected)
    assert ours.render_chat(messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ours.encode("héllo world", add_special_tokens=False) == hf.encode(
        "héllo world", add_special_tokens=False
    )


def test_template_raise_exception_is_a_400(hf_dir):
    with pytest.raises(BadRequest, match="unknown role tool"):
        Tokenizer.from_dir(hf_dir).encode_chat([{"role": "tool", "content": "x"}])


def test_missing_tokenizer_names_the_file(tmp_path):
    # the file, not gateway.model_path: that is no key a user sets (the launcher fills it)
    with pytest.raises(TokenizerLoadError, match="tokenizer.json not found") as err:
        Tokenizer.from_dir(tmp_path)
    assert "model_path" not in str(err.value)


def test_no_template_is_a_clear_400(tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(BadRequest, match="no chat template"):
        Tokenizer.from_dir(tmp_path).encode_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback", "embedded"])
def test_encode_gives_the_ids_of_the_libraries_plain_encode(kind):
    """`Tokenizer.encode` takes the fast batch path (no offsets): the same ids as `encode`,
    added and special tokens and the special-token switch included."""
    from tokenizers import Tokenizer as HF

    from tests.worker.grammar_tokenizers import EMBEDDED, byte_fallback_bpe, byte_level_bpe

    hf = {"byte_level": byte_level_bpe, "byte_fallback": byte_fallback_bpe,
          "embedded": lambda: HF.from_file(str(EMBEDDED))}[kind]()
    tok = Tokenizer(hf, {})
    specials = ["<|endoftext|>", "<tool_call>", "<s>", "</s>", "<|im_end|>", "<think>"]
    texts = ["", " leading", "héllo 🙂 wörld  x", "a=12;b=34;\nq?", "Ünïcödé ∑ 東京 " * 30,
             *(f"before {s} after{s}" for s in specials)]
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special).ids
