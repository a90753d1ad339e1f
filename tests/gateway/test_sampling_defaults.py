"""generation_config.json's sampling defaults (gateway/sampling_defaults.py): what a request
leaves out takes the model's value; what it sends wins; `none` keeps the API's defaults; a
value no request could send is refused naming the file and the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gateway.config import GatewayConfigError
from gateway.sampling_defaults import load_sampling_defaults
from tests.gateway.gw_doubles import (
    ScriptedWorker,
    fast_config,
    running_app,
    wait_workers,
    workers,
)
from tests.gateway.test_gateway_api import script_for

QWEN3 = {"do_sample": True, "eos_token_id": [1, 2], "temperature": 0.6, "top_p": 0.95,
         "top_k": 20, "transformers_version": "4.51.0"}


def _model(tmp_path: Path, tok_dir: Path, generation: dict | str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tok_dir, model)
    text = generation if isinstance(generation, str) else json.dumps(generation)
    (model / "generation_config.json").write_text(text)
    return model


def test_the_files_sampling_fields_are_read_and_checked(tmp_path: Path, tok_dir: Path) -> None:
    model = _model(tmp_path, tok_dir, QWEN3)
    assert load_sampling_defaults(str(model), "auto") == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20}  # do_sample, eos ids: not sampling
    assert load_sampling_defaults(str(model), "none") == {}
    assert load_sampling_defaults(str(tok_dir), "auto") == {}  # no file
    for bad, says in (({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
                      ({"temperature": "hot"}, "temperature must be a number >= 0"),
                      ({"top_k": 2.5}, "top_k must be a number -1 (off) or >= 0"),
                      ("{not json", "unreadable")):
        model = _model(tmp_path / says[:8], tok_dir, bad)
        with pytest.raises(GatewayConfigError, match="generation_config.json: ") as err:
            load_sampling_defaults(str(model), "auto")
        assert says in str(err.value) and "gateway.generation_config: none" in str(err.value)


@pytest.mark.anyio
async def test_a_request_takes_the_models_defaults_for_what_it_leaves_out(
    tmp_path: Path, tok_dir: Path
) -> None:
    model = _model(tmp_path, tok_dir, {**QWEN3, "min_p": 0.05, "repetition_penalty": 1.1})
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with workers(w), running_app(fast_config(model, workers=(w.url,))) as c:
        await wait_workers(c)
        for body in ({}, {"temperature": 0.2, "top_k": -1}, {"temperature": None}):
            r = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, **body})
            assert r.status_code == 200, r.text
        left_out, own, null = (req.sampling for req in w.requests)
        assert (left_out.temperature, left_out.top_k) == (pytest.approx(0.6), 20)
        assert left_out.top_p == pytest.approx(0.95) and left_out.min_p == pytest.approx(0.05)
        assert left_out.repetition_penalty == pytest.approx(1.1)
        # the request's own fields win (top_k -1: off, not the file's 20); the rest: the file's
        assert (own.temperature, own.top_k) == (pytest.approx(0.2), 0)
        assert own.top_p == pytest.approx(0.95)
        assert null.temperature == pytest.approx(0.6)  # null means left out


@pytest.mark.anyio
async def test_none_keeps_the_api_defaults(tmp_path: Path, tok_dir: Path) -> None:
    model = _model(tmp_path, tok_dir, QWEN3)
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with workers(w), running_app(
            fast_config(model, workers=(w.url,), generation_config="none")) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 200, r.text
        s = w.requests[0].sampling
        assert (s.temperature, s.top_p, s.top_k, s.min_p) == (1.0, 1.0, 0, 0.0)
