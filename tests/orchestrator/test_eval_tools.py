"""`tandem eval --task lookup`: the tool loop through the openai client, against a chat double."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import main
from orchestrator.tasks import lookup
from tests.orchestrator.chat_double import ChatDouble, ChatDoubleState

SEED = 11


def eval_argv(url: str, n: int = 12, bar: float = 0.9, *extra: str) -> list[str]:
    return ["eval", "--url", url, "--task", "lookup", "--samples", str(n), "--concurrency", "3",
            "--min-accuracy", str(bar), "--seed", str(SEED), *extra]


def test_right_answers_pass_and_the_loop_sends_what_a_client_should(
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = ChatDoubleState()
    with ChatDouble(state) as url:
        assert main(eval_argv(url, n=12)) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "accuracy: 1.000 (12/12)"
    assert "tool calls right: 12/12" in out.err
    assert "answers right after the tool results: 12/12" in out.err
    assert len(state.requests) == 24  # two turns per problem
    problems = {p.prompt: p for p in lookup.make_problems(12, SEED)}
    for body in state.requests:
        assert body["model"] == "double-model" and body["temperature"] == 0.0
        assert body["tools"] == [lookup.LOOKUP_TOOL]
        assert "chat_template_kwargs" not in body
        user = body["messages"][0]
        assert user["role"] == "user" and user["content"] in problems
        problem = problems[user["content"]]
        if len(body["messages"]) == 1:
            assert body["max_tokens"] == lookup.calls_max_tokens(problem)
            assert body["max_tokens"] >= 47 * len(problem.missing) + 1  # every call and eos
            continue
        assert body["max_tokens"] == lookup.answer_max_tokens() == lookup.ANSWER_MAX_TOKENS
        assistant, *tools = body["messages"][1:]
        assert [json.loads(c["function"]["arguments"]) for c in assistant["tool_calls"]] == (
            lookup.expected_calls(problem))
        # One tool message per call, answering its id with the hidden value.
        assert [t["tool_call_id"] for t in tools] == [c["id"] for c in assistant["tool_calls"]]
        assert [t["content"] for t in tools] == [v for _, v in problem.missing]


@pytest.mark.parametrize(
    ("wrong", "turn", "stage_calls", "stage_answers"),
    [
        ("wrong_call", "calls", 9, 9),  # wrong order and an extra call
        ("bad_json", "calls", 9, 9),  # arguments that are not JSON
        ("no_call", "calls", 9, 9),  # answered in text instead of calling
        ("wrong_answer", "answer", 12, 9),
    ],
)
def test_each_way_of_going_wrong_counts_as_wrong(
    capsys: pytest.CaptureFixture[str], wrong: str, turn: str, stage_calls: int, stage_answers: int
) -> None:
    seen: dict[str, int] = {"calls": 0, "answer": 0}

    def rule(index: int, this_turn: str) -> str:
        seen[this_turn] += 1
        return wrong if this_turn == turn and seen[this_turn] % 4 == 0 else "right"

    with ChatDouble(ChatDoubleState(rule=rule)) as url:
        assert main(eval_argv(url, 12, 0.9)) == 1
        assert main(eval_argv(url, 12, 0.7)) == 0
    out = capsys.readouterr()
    assert "accuracy: 0.750 (9/12)" in out.out and "below --min-accuracy 0.900" in out.err
    assert f"tool calls right: {stage_calls}/12" in out.err
    assert f"answers right after the tool results: {stage_answers}/12" in out.err


def test_failed_requests_count_as_wrong_and_are_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = ChatDoubleState(rule=lambda i, turn: "fail" if turn == "answer" else "right")
    with ChatDouble(state) as url:
        assert main(eval_argv(url, n=6)) == 1
    out = capsys.readouterr()
    assert "accuracy: 0.000 (0/6)" in out.out
    assert "failed requests: 6/6" in out.err and "HTTP 503: no healthy worker" in out.err
    assert len(state.requests) == 12  # no retries: a failure is counted, not hidden


def test_thinking_sends_the_template_kwarg_and_requires_reasoning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = ChatDoubleState()
    with ChatDouble(state) as url:
        assert main(eval_argv(url, 8, 0.9, "--enable-thinking")) == 0
        assert capsys.readouterr().out.strip() == "accuracy: 1.000 (8/8)"
        state.rule = lambda i, turn: "no_reasoning" if turn == "answer" else "right"
        assert main(eval_argv(url, 8, 0.9, "--enable-thinking")) == 1
        assert "accuracy: 0.000 (0/8)" in capsys.readouterr().out
    first = state.requests[0]
    assert first["chat_template_kwargs"] == {"enable_thinking": True}
    problem = next(p for p in lookup.make_problems(8, SEED)
                   if p.prompt == first["messages"][0]["content"])
    assert first["max_tokens"] == lookup.calls_max_tokens(problem) + lookup.THINK_MAX_TOKENS


def test_thinking_is_refused_for_a_completion_task(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--url", "http://127.0.0.1:9", "--task", "arith", "--enable-thinking"]
    assert main(argv) == 2
    assert "--enable-thinking needs a chat task" in capsys.readouterr().err


def test_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(eval_argv("http://127.0.0.1:9", n=2)) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
