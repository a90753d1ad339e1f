"""Token-id mode (a checkpoint with no tokenizer files) and `return_token_ids`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tokenizer import IdsOnlyTokenizer, Tokenizer, load_tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, running_app, workers

pytestmark = pytest.mark.anyio
TOKENS = [70, 71, 72, 73]


def data_events(text: str) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n")
            if e.startswith("data: {")]


@pytest.fixture
def no_tok_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint written by save_pretrained alone
    return tmp_path


def test_a_directory_without_tokenizer_files_means_token_ids(no_tok_dir: Path,
                                                             tok_dir: Path) -> None:
    assert isinstance(load_tokenizer(no_tok_dir), IdsOnlyTokenizer)
    assert type(load_tokenizer(tok_dir)) is Tokenizer
    (no_tok_dir / "tokenizer.model").write_bytes(b"x")  # a tokenizer, just not one we read
    with pytest.raises(ValueError, match="tokenizer.json not found") as err:
        load_tokenizer(no_tok_dir)
    assert "model_path" not in str(err.value)


async def test_token_id_prompts_answer_with_token_ids(no_tok_dir: Path) -> None:
    w = ScriptedWorker(script=Script(tokens=TOKENS, finish_reason="length"))
    async with workers(w), running_app(fast_config(no_tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and choice["token_ids"] == TOKENS
        assert choice["prompt_token_ids"] == [5, 6, 7]
        assert r.json()["usage"]["completion_tokens"] == 4
        r = await c.post("/v1/completions", json={"prompt": [[5, 6, 7]], "max_tokens": 4,
                                                  "stream": True, "logprobs": 1})
        chunks = [e["choices"][0] for e in data_events(r.text) if e["choices"]]
        assert [t for ch in chunks for t in ch["token_ids"]] == TOKENS
        assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
        assert all("prompt_token_ids" not in ch for ch in chunks[1:])
        assert chunks[0]["logprobs"]["tokens"][0] == "token_id:70"  # no text to name it by
        assert chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/completions", {"prompt": [1, 2], "stop": ["\n"]}, "stop"),
])
async def test_what_needs_text_is_a_clear_400(no_tok_dir: Path, path: str, body: dict,
                                              param: str) -> None:
    w = ScriptedWorker(script=Script(tokens=TOKENS))
    async with workers(w), running_app(fast_config(no_tok_dir, workers=(w.url,))) as c:
        r = await c.post(path, json={"max_tokens": 2, **body})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "no_tokenizer" and err["param"] == param
        assert "no tokenizer" in err["message"]
    assert w.requests == []  # nothing reached the worker


async def test_return_token_ids_with_a_tokenizer(tok_dir: Path) -> None:
    ids = Tokenizer.from_dir(tok_dir).encode("hello world", add_special_tokens=False)
    w = ScriptedWorker(script=Script(tokens=ids, finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", json={"prompt": "the", "return_token_ids": True})
        choice = r.json()["choices"][0]
        assert choice["text"] == "hello world" and choice["token_ids"] == ids
        r = await c.post("/v1/completions", json={"prompt": "the"})
        assert "token_ids" not in r.json()["choices"][0]  # only when asked

