"""The `arith` task family: determinism, prompt length in KV pages, first-page dependence,
scoring."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from orchestrator.tasks import UnknownTaskError, arith, get_task

TOKENIZER_JSON = Path(__file__).resolve().parents[2] / "models" / "tandem-arith" / "tokenizer.json"
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def test_same_seed_same_problems_and_prefix_stable() -> None:
    assert arith.make_problems(50, 7) == arith.make_problems(50, 7)
    assert arith.make_problems(10, 7) == arith.make_problems(50, 7)[:10]
    assert arith.make_problems(50, 7) != arith.make_problems(50, 8)
    assert arith.make_problems(0, 7) == []


def test_problems_are_varied() -> None:
    problems = arith.make_problems(200, 0)
    assert len({p.prompt for p in problems}) == 200
    assert len({p.answer for p in problems}) > 150
    assert (
        len({len(p.prompt) for p in problems}) == arith.MAX_ASSIGNMENTS - arith.MIN_ASSIGNMENTS + 1
    )


def test_asks_for_the_first_and_the_last_assignment() -> None:
    for p in arith.make_problems(100, 5):
        body, question = p.prompt.split("\n")
        assignments = body.rstrip(";").split(";")
        assert question == f"{assignments[0][0]},{assignments[-1][0]}?"
        assert p.answer == f"{assignments[0]},{assignments[-1]}"
        assert len({a[0] for a in assignments}) == len(assignments)  # names are distinct


def test_every_prompt_spans_at_least_four_pages(tokenizer: Tokenizer) -> None:
    lengths = [len(tokenizer.encode(p.prompt).ids) for p in arith.make_problems(500, 0)]
    assert min(lengths) >= 4 * PAGE_SIZE
    assert min(lengths) >= 100 and max(lengths) <= 160


def test_reference_solver_agrees_with_answers() -> None:
    for p in arith.make_problems(300, 1):
        assert arith.solve(p.prompt) == p.answer


def test_first_assignment_lies_in_the_first_page_and_is_always_asked(tokenizer: Tokenizer) -> None:
    for p in arith.make_problems(300, 2):
        first_page = tokenizer.decode(tokenizer.encode(p.prompt).ids[:PAGE_SIZE])
        first_assignment = p.prompt.split(";", 1)[0]  # e.g. "k=41"
        assert first_page.startswith(first_assignment + ";")
        assert p.answer.startswith(first_assignment + ",")


def test_corrupting_the_first_page_changes_every_answer(tokenizer: Tokenizer) -> None:
    """Any change to the first assignment's value (tokens 2-3, page 0) changes the answer."""
    rng = random.Random(0)
    for p in arith.make_problems(300, 3):
        ids = tokenizer.encode(p.prompt).ids
        pos = rng.choice([2, 3])  # a value digit of the first assignment
        digit = tokenizer.id_to_token(ids[pos])
        new = rng.choice([d for d in "0123456789" if d != digit])
        ids[pos] = tokenizer.token_to_id(new)
        corrupted = tokenizer.decode(ids)
        assert len(corrupted) == len(p.prompt)
        assert arith.solve(corrupted) != p.answer
        assert not arith.score(p, arith.solve(corrupted) + arith.STOP)


def test_score_uses_the_text_before_the_terminator() -> None:
    # Two assignments: the first and the last.
    p = arith.Problem(prompt="k=41;x=93;\nk,x?", answer="k=41,x=93")
    assert arith.score(p, "k=41,x=93;")
    assert arith.score(p, "k=41,x=93;k=00,x=00;")  # only the text before the first STOP counts
    assert arith.score(p, " k=41,x=93 ;\n")
    assert arith.score(p, "k=41,x=93")  # the server may already have cut the stop string
    assert not arith.score(p, "k=41,x=94;")
    assert not arith.score(p, "k=41;x=93;")
    assert not arith.score(p, "k=41,x=93,y=00;")
    assert not arith.score(p, "")
    assert not arith.score(p, ";k=41,x=93")


def test_constants_a_client_needs(tokenizer: Tokenizer) -> None:
    longest = max(len(p.answer) for p in arith.make_problems(200, 4))
    assert longest + 2 <= arith.ANSWER_MAX_TOKENS  # the answer, STOP and eos, one token each
    assert arith.STOP == ";"
    assert arith.TRAIN_SEED_MIN > 10**6  # every everyday --seed is an evaluation seed


def test_bad_arguments_raise_typed_errors() -> None:
    with pytest.raises(arith.TaskArgumentError, match="n"):
        arith.make_problems(-1, 0)
    with pytest.raises(arith.TaskArgumentError, match="num_assignments"):
        arith.make_problem(random.Random(0), 27)
    with pytest.raises(arith.TaskArgumentError, match="question"):
        arith.solve("k=41;")


def test_get_task() -> None:
    assert get_task("arith") is arith
    with pytest.raises(UnknownTaskError, match="arith"):
        get_task("gsm8k")
