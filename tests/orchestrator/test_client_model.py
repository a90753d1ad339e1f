"""`tandem eval` and `tandem bench` ask the server its models before any load: an unreachable
server is exit 2 even with `--model` given, and a `--model` the server does not list is one line
naming the ones it does, not a request failed per problem."""

from __future__ import annotations

import socket

import pytest

import orchestrator.client
from orchestrator.cli import main
from tests.orchestrator.chat_double import ChatDouble, ChatDoubleState
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble

UNREACHABLE = "http://127.0.0.1:9"
LOAD = {"eval": ["--task", "arith", "--samples", "3"],
        "lookup": ["--task", "lookup", "--samples", "3"],
        "bench": ["--num-requests", "3", "--output-len", "2", "--input-len", "4"]}


def _argv(kind: str, url: str, *extra: str) -> list[str]:
    return ["bench" if kind == "bench" else "eval", "--url", url, *LOAD[kind], *extra]


@pytest.mark.parametrize("kind", ["eval", "lookup", "bench"])
def test_an_unreachable_server_is_exit_2_with_a_model_named(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(kind, UNREACHABLE, "--model", "tandem-arith")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach http://127.0.0.1:9") and "\n" not in err


@pytest.mark.parametrize("kind", ["eval", "bench"])
def test_a_model_the_server_does_not_list_is_one_line(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    state = DoubleState()
    with OpenAIDouble(state) as url:
        assert main(_argv(kind, url, "--model", "nope")) == 2
    out = capsys.readouterr()
    assert out.out == "" and state.requests == []  # nothing sent, nothing scored
    assert out.err.strip() == (f"error: --model 'nope' is not served at {url}: it serves "
                               "'double-model'; pass one of them (or leave --model out for "
                               "the first)")


def test_a_model_the_chat_server_does_not_list_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = ChatDoubleState()
    with ChatDouble(state) as url:
        assert main(_argv("lookup", url, "--model", "nope")) == 2
    err = capsys.readouterr().err.strip()
    assert state.requests == []
    assert err.startswith("error: --model 'nope' is not served at ") and "\n" not in err
    assert "it serves 'double-model'" in err


@pytest.mark.parametrize("kind", ["eval", "bench"])
@pytest.mark.parametrize("key", [None, "wrong"])
def test_a_missing_or_wrong_key_names_the_flag(
    kind: str, key: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    with OpenAIDouble(DoubleState(api_key="k1")) as url:
        assert main(_argv(kind, url, *([] if key is None else ["--api-key", key]))) == 2
    err = capsys.readouterr().err.strip()
    assert "HTTP 401" in err and "\n" not in err
    given = "wrong" if key else "none"
    assert err.endswith(f"; the server wants an API key: pass --api-key KEY (given: {given})")


def test_the_tool_loops_unreachable_line_reads_as_the_completion_gates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(_argv("lookup", UNREACHABLE)) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: cannot reach http://127.0.0.1:9: APIConnectionError: Connection "
                   "error. Is the server running?")


def test_a_server_that_never_answers_is_exit_2_not_a_wait_of_the_request_timeout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listening socket that nobody accepts (a frozen gateway): the model question gives up
    after its own timeout (10 s; 1 s here), as the completion gate's does, not after the 600 s
    of a request."""
    monkeypatch.setattr(orchestrator.client, "MODELS_TIMEOUT_S", 1.0)
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)
        url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
        assert main(_argv("lookup", url)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot reach {url}: APITimeoutError")
