"""The `lookup` task family: problem shapes, determinism, the expected calls, scoring."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from orchestrator.tasks import TaskMode, arith, get_task, lookup

TOKENIZER_JSON = Path(__file__).resolve().parents[2] / "models" / "tandem-arith" / "tokenizer.json"


def test_registered_as_a_tool_loop_task() -> None:
    assert get_task("lookup") is lookup
    assert lookup.MODE is TaskMode.TOOL_LOOP and arith.MODE is TaskMode.COMPLETION
    fn = lookup.LOOKUP_TOOL["function"]
    assert lookup.LOOKUP_TOOL["type"] == "function" and fn["name"] == lookup.TOOL_NAME == "lookup"
    assert fn["parameters"] == {"type": "object", "properties": {"name": {"type": "string"}},
                                "required": ["name"]}


def test_same_seed_same_problems_and_prefix_stable() -> None:
    assert lookup.make_problems(40, 3) == lookup.make_problems(40, 3)
    assert lookup.make_problems(10, 3) == lookup.make_problems(40, 3)[:10]
    assert lookup.make_problems(40, 3) != lookup.make_problems(40, 4)
    assert lookup.make_problems(0, 3) == []


def test_both_kinds_and_every_bare_size_occur() -> None:
    problems = lookup.make_problems(300, 0)
    kinds = [p.kind for p in problems]
    assert 100 < kinds.count(lookup.Kind.BARE) < 200
    bare_sizes = {len(p.asked) for p in problems if p.kind is lookup.Kind.BARE}
    assert bare_sizes == {1, 2, 3}
    assert len({p.prompt for p in problems}) > 250


def test_bare_problems_ask_only_unassigned_names() -> None:
    for p in lookup.make_problems(200, 1):
        if p.kind is not lookup.Kind.BARE:
            continue
        assert "=" not in p.prompt and "\n" not in p.prompt
        assert p.prompt == ",".join(p.asked) + "?"
        assert p.known == () and [n for n, _ in p.missing] == list(p.asked)
        assert len(set(p.asked)) == len(p.asked)
        assert p.answer == ",".join(f"{n}={v}" for n, v in p.missing)


def test_mixed_problems_ask_the_first_assignment_and_a_missing_name() -> None:
    for p in lookup.make_problems(200, 2):
        if p.kind is not lookup.Kind.MIXED:
            continue
        body, question = p.prompt.split("\n")
        assignments = dict(a.split("=") for a in body.rstrip(";").split(";"))
        assert lookup.MIN_ASSIGNMENTS <= len(assignments) <= lookup.MAX_ASSIGNMENTS
        first = body.split(";", 1)[0]
        (missing, value), = p.missing
        assert question == f"{first[0]},{missing}?"
        assert missing not in assignments and p.known == ((first[0], first[2:]),)
        assert p.answer == f"{first},{missing}={value}"
        # Solvable: arith's reference solver finds the answer once the tool's value is added.
        assert arith.solve(f"{body}{missing}={value};\n{question}") == p.answer


def test_prompts_fit_the_embedded_model_with_the_tool_and_the_calls() -> None:
    """The answer turn (tool, question, calls, results, answer) fits in 512 positions.

    tests/models renders the real template; this bounds it from the token counts: a call is
    47 tokens, a result block 7, the role and think markers fewer than 20 in all.
    """
    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    tool = len(json.dumps(lookup.LOOKUP_TOOL)) + 4
    for p in lookup.make_problems(300, 5):
        prompt = tool + len(tok.encode(p.prompt).ids) + 20
        assert prompt + lookup.calls_max_tokens(p, thinking=True) <= 512
        assert lookup.calls_max_tokens(p) >= 47 * len(p.missing) + 1  # every call and eos
        assert prompt + (47 + 7) * len(p.missing) + lookup.answer_max_tokens(True) <= 512


def test_check_calls() -> None:
    p = lookup.make_problem(random.Random(0), lookup.Kind.BARE, num_bare=2)
    (a, _), (b, _) = p.missing
    right = [("lookup", json.dumps({"name": a})), ("lookup", f'{{"name":"{b}"}}')]
    assert lookup.check_calls(p, right)
    assert not lookup.check_calls(p, right[::-1])  # order matters
    assert not lookup.check_calls(p, right[:1])  # one per missing variable
    assert not lookup.check_calls(p, [*right, right[0]])
    assert not lookup.check_calls(p, [("search", right[0][1]), right[1]])
    assert not lookup.check_calls(p, [("lookup", "{'name': 'x'}"), right[1]])  # not JSON
    assert not lookup.check_calls(p, [("lookup", json.dumps({"name": a, "x": 1})), right[1]])
    assert not lookup.check_calls(p, [])


def test_tool_result_is_the_hidden_value_or_an_error() -> None:
    p = lookup.make_problem(random.Random(1), lookup.Kind.MIXED, num_assignments=20)
    (name, value), = p.missing
    assert lookup.tool_result(p, json.dumps({"name": name})) == value
    assert lookup.tool_result(p, json.dumps({"name": p.asked[0]})).startswith("error:")
    assert lookup.tool_result(p, "not json").startswith("error:")
    assert lookup.tool_result(p, "[1]").startswith("error:")


def test_score_uses_the_text_before_the_terminator() -> None:
    p = lookup.make_problem(random.Random(2), lookup.Kind.BARE, num_bare=1)
    assert lookup.score(p, p.answer + ";") and lookup.score(p, p.answer)
    assert lookup.score(p, f" {p.answer};junk")
    assert not lookup.score(p, "")
    # Reasoning left in the content is wrong: the server must split it out.
    assert not lookup.score(p, f"<think>\n{p.answer};\n</think>\n\n{p.answer};")


def test_bad_arguments_raise_typed_errors() -> None:
    rng = random.Random(0)
    with pytest.raises(arith.TaskArgumentError, match="n"):
        lookup.make_problems(-1, 0)
    with pytest.raises(arith.TaskArgumentError, match="num_assignments"):
        lookup.make_problem(rng, lookup.Kind.MIXED, num_assignments=26)
    with pytest.raises(arith.TaskArgumentError, match="num_bare"):
        lookup.make_problem(rng, lookup.Kind.BARE, num_bare=0)
