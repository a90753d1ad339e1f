"""Text a newcomer's checkpoint answers, served 1P1D and read with the official `openai` client,
against what transformers makes of the same files.

The checkpoint is a tiny random Llama with a byte-level BPE tokenizer (GPT-2 / Llama-3 / Qwen
style) trained here on CJK, emoji, combining marks and code, and a ChatML fine-tune's files: its
chat template in `chat_template.jinja`, `<|im_end|>` as the tokenizer's eos while config.json
and generation_config.json keep `<|endoftext|>`. Sampled at temperature 1, its tokens split
characters (a byte-level piece of an emoji) and its text has every kind of character, so:

- streamed deltas join to the non-streamed text, which is what transformers decodes for the
  output's token ids after the prompt's, with `skip_special_tokens` true and false;
- stop strings cut both at the same place, wherever they fall among tokens and characters;
- `usage.prompt_tokens` is the length of transformers' `apply_chat_template(..., tokenize=True)`;
- logprobs' `bytes` join to the text; a token inside a character is named by escaped bytes;
- the tokenizer's eos ends the answer (not written, even where special tokens are shown).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from orchestrator.launch.background import running_cluster
from tests.worker.conftest import build_tiny_checkpoint

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

CORPUS = ["日本語のテキストと東京、中文汉字、한국어 🙂🚀👍🏽 café naïve e\u0301 ñ Ünïcödé ∑ 🇯🇵",
          "Hello world, this is a test. The quick brown fox.\n\n  def f(x):\n\treturn x + 1"] * 20
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPTS = ["日本語のテキスト 🙂", " leading space", "line\n\nbreaks\t", "e\u0301 👍🏽 🇯🇵",
           "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "  spaces and\nnewlines "},
            {"role": "user", "content": "東京 🙂 e\u0301 <|im_end|> naïve"}]
MODEL = "chatml-bytelevel"


def build_checkpoint(path: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    build_tiny_checkpoint(path, "llama", vocab_size=tok.get_vocab_size(), eos_token_id=0,
                          bos_token_id=0, pad_token_id=0, max_position_embeddings=512)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False}))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _ports(n: int) -> list[int]:
    """`n` ports free now in 45000-45999 (this suite's range for pinned ports)."""
    found: list[int] = []
    for port in range(45900, 46000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    pytest.skip("no free ports in 45900-45999")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, Any]]:
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL)
    gw, prefill, decode = _ports(3)
    with running_cluster("configs/tiny-1p1d.yaml", f"roles.prefill.base_port={prefill}",
                         f"roles.decode.base_port={decode}", "gateway.tool_call_parser=none",
                         "gateway.reasoning_parser=none", tmp=tmp_path_factory.mktemp("pd"),
                         model=path, port=gw) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        yield client, transformers.AutoTokenizer.from_pretrained(str(path))
        c.wait_drained()


def _completion(client: openai.OpenAI, prompt: str, skip: bool, seed: int,
                **extra: Any) -> tuple[str, str, list[int], Any]:
    """The non-streamed text, the streamed one, the output ids and the logprobs."""
    kw: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=1.0,
                              seed=seed, extra_body={"skip_special_tokens": skip,
                                                     "return_token_ids": True,
                                                     "ignore_eos": True}, **extra)
    r = client.completions.create(logprobs=0, **kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    return r.choices[0].text, streamed, r.choices[0].model_extra["token_ids"], r.choices[0]


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_is_the_whole_and_what_transformers_decodes(served: Any, skip: bool) -> None:
    client, hf = served
    split = False
    for prompt in PROMPTS:
        for seed in (1, 2):
            text, streamed, ids, choice = _completion(client, prompt, skip, seed)
            assert streamed == text, (prompt, seed)
            pids = choice.model_extra["prompt_token_ids"]
            assert pids == hf(prompt)["input_ids"]
            before = hf.decode(pids, skip_special_tokens=skip)
            assert text == hf.decode(pids + ids, skip_special_tokens=skip)[len(before):]
            tokens = choice.logprobs.tokens
            assert len(tokens) == len(ids)
            split |= any("\\x" in t for t in tokens)
    assert split  # some output token split a character


def test_stop_strings_cut_stream_and_whole_alike(served: Any) -> None:
    client, _ = served
    checked = 0
    for seed in (3, 4, 5):
        text, _, _, _ = _completion(client, "東京 🙂", True, seed)
        wide = [i for i, ch in enumerate(text) if len(ch.encode()) > 1]
        # two characters around a multi-byte one, and one multi-byte character alone
        stops = [text[i - 1:i + 1] for i in wide if i > 0][:2] + [text[i] for i in wide[-1:]]
        for stop in stops:
            want = text[:text.find(stop)]
            whole, streamed, ids, _ = _completion(client, "東京 🙂", True, seed, stop=[stop])
            assert whole == streamed == want, (seed, stop)
            checked += 1
    assert checked >= 3


def test_chat_usage_logprob_bytes_and_the_tokenizers_eos(served: Any) -> None:
    client, hf = served
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0,
                              seed=7, extra_body={"skip_special_tokens": False,
                                                  "ignore_eos": True})
    r = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    assert r.usage is not None and r.usage.prompt_tokens == len(want)
    content = r.choices[0].message.content or ""
    parts, usage = [], None
    for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw):
        parts.append(c.choices[0].delta.content or "" if c.choices else "")
        usage = c.usage or usage
    assert "".join(parts) == content and usage is not None and usage.prompt_tokens == len(want)
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    entries = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes or []) for e in entries)
    assert joined.decode("utf-8", "replace") == content
    assert all("\ufffd" not in e.token for e in entries)
    # The tokenizer's eos (not config.json's) ends the answer, its text not written.
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       logit_bias={str(im_end): 100},
                                       extra_body={"skip_special_tokens": False})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.usage is not None and r.usage.completion_tokens == 1
