"""models/chat_data.py, the embedded model's training samples: every format renders through the
chat template, fits the context, and teaches exactly what the template renders back."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from orchestrator.tasks import lookup

MODELS = Path(__file__).resolve().parents[2] / "models"
sys.path.insert(0, str(MODELS))  # models/ holds scripts, not a package
import chat_data  # noqa: E402
from chat_data import EOS, Format, SampleMaker  # noqa: E402

EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODELS / "tandem-arith" / "tokenizer.json"))


def test_the_template_trained_on_is_the_one_shipped() -> None:
    shipped = json.loads((MODELS / "tandem-arith" / "tokenizer_config.json").read_text())
    assert shipped["chat_template"] == chat_data.TEMPLATE_PATH.read_text()


def test_every_format_fits_the_context(tokenizer: Tokenizer) -> None:
    maker = SampleMaker(min_assignments=4)
    rng = random.Random(0)
    for fmt in Format:
        for _ in range(60):
            s = maker.draw(rng, fmt)
            n = len(tokenizer.encode(s.prompt).ids) + len(tokenizer.encode(s.completion).ids)
            assert n <= 480, (fmt, n)  # max_position_embeddings is 512
            assert s.completion.endswith(EOS) and s.completion.count(EOS) == 1


def test_thinking_formats_and_the_rest(tokenizer: Tokenizer) -> None:
    maker = SampleMaker(min_assignments=4)
    rng = random.Random(1)
    for fmt in Format:
        s = maker.draw(rng, fmt)
        if fmt is Format.RAW:
            assert "<|" not in s.prompt
        elif fmt in chat_data.THINKING:
            assert s.prompt.endswith("<|assistant|>") and s.completion.startswith("<think>\n")
            assert "\n</think>\n\n" in s.completion
        else:
            assert s.prompt.endswith("<|assistant|>" + EMPTY_THINK)
            assert "<think>" not in s.completion


def test_calls_are_written_as_the_template_renders_them_back() -> None:
    """What the model learns to write is, token for token, what the next turn's prompt shows."""
    template, _ = chat_data.make_environments()
    rng = random.Random(2)
    message = chat_data.assistant_calls(rng, ["q", "b"])
    rendered = template.render(messages=[message], add_generation_prompt=False)
    expected = "\n".join(chat_data.tool_call_text(n) for n in ("q", "b"))
    assert rendered == "<|assistant|>" + expected + EOS
    sample = SampleMaker(4).draw(random.Random(3), Format.CALLS)
    assert sample.completion.startswith("<tool_call>\n")
    turn = lookup.split_raw_output(sample.completion.removesuffix(EOS))
    assert turn.well_formed and turn.content == "" and turn.calls


def test_answers_after_results_match_the_task(tokenizer: Tokenizer) -> None:
    maker = SampleMaker(min_assignments=20)
    rng = random.Random(4)
    for _ in range(30):
        s = maker.draw(rng, Format.ANSWER)
        assert s.prompt.count("<tool_response>") == s.prompt.count("<tool_call>") >= 1
        question = s.prompt.split("<|user|>")[1].split("<|endoftext|>")[0].rsplit("\n", 1)[-1]
        names = question.rstrip("?").split(",")
        answer = s.completion.removesuffix(";" + EOS)
        assert [a.split("=")[0] for a in answer.split(",")] == names


def test_the_stream_is_deterministic_in_its_seed() -> None:
    maker = SampleMaker(min_assignments=4)
    a = [maker.draw(random.Random(5)) for _ in range(3)]
    b = [maker.draw(random.Random(5)) for _ in range(3)]
    assert a == b
