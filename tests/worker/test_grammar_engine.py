"""Constrained decoding through the engine on the embedded model: every output matches its
grammar (checked with jsonschema / re, not xgrammar), greedy and sampled; logit_bias moves
greedy picks; and the engine's rules: no matcher is fed twice across a preemption, overlapped
decode never runs a constrained row, and every end (stop, abort, failure) frees the matcher."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.worker.grammar_helpers import (
    EMBEDDED,
    MAX_TOKENS,
    REGEX,
    Case,
    check_output,
    corpus,
    logit_bias,
    prompt,
    tokenizer,
)
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.grammar import GrammarError
from worker.request import Request
from worker.sampling import SamplingParams, StructuredKind, StructuredOutput

TOK = tokenizer()
EOS = 2


def make_engine(*, num_pages: int = 512, page_size: int = 16, overlap: str = "off",
                max_num_seqs: int = 32, path: str = str(EMBEDDED.parent)) -> Engine:
    return Engine(WorkerConfig(
        model=ModelConfig(path=path, dtype="float32"),
        cache=CacheConfig(page_size=page_size, num_pages=num_pages),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, chunked_prefill_size=256,
                                  overlap=overlap),  # type: ignore[arg-type]
    ))


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    error: str = ""

    @property
    def text(self) -> str:
        return TOK.decode([t for t in self.tokens if t != EOS], skip_special_tokens=False)

    def sink(self) -> Callable[[RequestOutput], None]:
        def take(out: RequestOutput) -> None:
            self.tokens.extend(out.token_ids)
            if out.finished:
                self.finish, self.error = out.finish_reason, out.error
        return take


def run(engine: Engine, requests: list[Request], *, steps: int = 5000) -> dict[str, Result]:
    results = {r.request_id: Result() for r in requests}
    for r in requests:
        if r.sampling.structured is not None:
            engine.grammars.compile(r.sampling.structured)  # what the server does at submit
        engine.submit(r, results[r.request_id].sink())
    for _ in range(steps):
        if all(res.finish for res in results.values()):
            break
        engine.step()
    assert all(res.finish for res in results.values()), "requests left unfinished"
    return results


def constrained(case: Case, rid: str, *, temperature: float = 0.0, seed: int | None = None,
                **sampling: object) -> Request:
    sampling.setdefault("logit_bias", logit_bias(TOK, case))
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                            structured=case.structured, **sampling)  # type: ignore[arg-type]
    return Request(rid, prompt(TOK), params)


def assert_clean(engine: Engine) -> None:
    assert engine.grammars.num_live == 0, "a matcher outlived its request"
    engine.scheduler.assert_drained()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


@pytest.mark.slow
def test_outputs_match_their_grammar_greedy_and_sampled(engine: Engine) -> None:
    cases = corpus()
    requests = [constrained(c, f"{c.name}/greedy") for c in cases]
    requests += [constrained(c, f"{c.name}/seed{s}", temperature=1.0, seed=s, top_p=0.95)
                 for c in cases for s in (1, 2)]
    results = run(engine, requests)
    for req in requests:
        res = results[req.request_id]
        case = next(c for c in cases if req.request_id.startswith(c.name + "/"))
        assert res.finish == "stop" and res.tokens[-1] == EOS, (req.request_id, res.text)
        check_output(case, res.text)
    assert_clean(engine)
    backend = engine.grammars.backend()
    # Each grammar compiled once; every other compile at submit and every matcher: a cache hit.
    assert backend.num_compiles == len(cases)
    assert backend.num_hits == 2 * len(requests) - len(cases)


def test_logit_bias_moves_greedy_picks(engine: Engine) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = run(engine, [Request("base", prompt(TOK), plain)])["base"].tokens
    q = TOK.token_to_id("q")
    assert q not in base
    pushed = dataclasses.replace(plain, logit_bias=((q, 100.0),))
    assert run(engine, [Request("push", prompt(TOK), pushed)])["push"].tokens == [q] * 6
    banned = dataclasses.replace(plain, logit_bias=((base[0], -100.0),))
    assert run(engine, [Request("ban", prompt(TOK), banned)])["ban"].tokens[0] != base[0]
    # Bias cannot take a token out of a grammar: the mask comes after it.
    regex = Case("regex", StructuredOutput(StructuredKind.REGEX, REGEX))
    forced = constrained(regex, "forced", logit_bias=((TOK.token_to_id("Z"), 100.0),))
    res = run(engine, [forced])["forced"]
    assert res.finish == "stop" and "Z" not in res.text
    check_output(regex, res.text)
    assert_clean(engine)


@pytest.mark.slow
def test_preemption_never_feeds_a_matcher_twice(engine: Engine) -> None:
    """A pool too small for the batch preempts and recomputes: the outputs (and so the
    matchers' states) are exactly those of an unpressed run."""
    names = ("json_schema:nested", "json_schema:patterns", "json_schema:refs_anyof")
    cases = [c for c in corpus() if c.name in names]
    roomy = run(engine, [constrained(c, c.name) for c in cases])
    tight_engine = make_engine(page_size=4, num_pages=36)
    tight = run(tight_engine, [constrained(c, c.name) for c in cases])
    assert tight_engine.scheduler.num_preemptions > 0
    for c in cases:
        assert tight[c.name].tokens == roomy[c.name].tokens, c.name
        check_output(c, tight[c.name].text)
    assert_clean(tight_engine)


@pytest.mark.slow
def test_overlapped_decode_never_runs_a_constrained_row(engine: Engine) -> None:
    cases = corpus()[2:4]  # two short ones
    reference = run(engine, [constrained(c, c.name) for c in cases])
    engine = make_engine(overlap="on")
    alone = run(engine, [constrained(c, c.name) for c in cases])
    assert engine.num_overlapped_steps == 0
    for c in cases:
        assert alone[c.name].tokens == reference[c.name].tokens
    # Beside an unconstrained request that outlives them, overlap resumes once they are done.
    free = Request("free", prompt(TOK), SamplingParams(temperature=0.0, max_tokens=60,
                                                       ignore_eos=True))
    mixed = run(engine, [constrained(c, c.name + "+") for c in cases] + [free])
    assert engine.num_overlapped_steps > 0
    for c in cases:
        assert mixed[c.name + "+"].tokens == reference[c.name].tokens
    assert_clean(engine)


def test_abort_frees_the_matcher_and_the_pages(engine: Engine) -> None:
    loop = Case("loop", StructuredOutput(StructuredKind.REGEX, "(ab)+"))
    running = constrained(loop, "running", ignore_eos=True)
    waiting = constrained(loop, "waiting", ignore_eos=True)
    res = {"running": Result(), "waiting": Result()}
    engine.grammars.compile(loop.structured)
    engine.submit(running, res["running"].sink())
    for _ in range(5):
        engine.step()
    assert running.grammar is not None and running.grammar.num_accepted > 0
    assert engine.grammars.num_live == 1
    engine.submit(waiting, res["waiting"].sink())
    engine.abort("running", "client left")
    engine.abort("waiting", "client left")  # both in the inbox: one queued, one decoding
    engine.step()
    assert res["running"].finish == res["waiting"].finish == "abort"
    assert running.grammar is None and waiting.grammar is None
    assert_clean(engine)


def test_a_refused_token_fails_only_its_request(engine: Engine) -> None:
    """A decode worker's first token that its grammar refuses (a PD peer that sampled it
    unmasked): that request fails, a neighbour in the same step goes on unharmed."""
    regex = Case("regex", StructuredOutput(StructuredKind.REGEX, REGEX))
    bad = constrained(regex, "bad")
    bad.output_token_ids.append(TOK.token_to_id("Z"))  # landed with the prompt, as decode's do
    good = constrained(regex, "good")
    results = run(engine, [bad, good])
    assert results["bad"].finish == "error" and "does not match the request's grammar" in (
        results["bad"].error)
    assert results["good"].finish == "stop"
    check_output(regex, results["good"].text)
    assert_clean(engine)


def test_a_failed_step_frees_its_matchers(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device or model error fails the step's requests (engine._fail): their matchers go."""
    regex = Case("regex", StructuredOutput(StructuredKind.REGEX, REGEX))
    req = constrained(regex, "doomed")
    res = Result()
    engine.grammars.compile(regex.structured)
    engine.submit(req, res.sink())
    engine.step()  # prefill and the first token, for real
    assert engine.grammars.num_live == 1

    def broken(plan: object, prev: object = None) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "forward", broken)  # the failure injected, nothing faked
    engine.step()
    assert res.finish == "error" and "device lost" in res.error
    assert_clean(engine)


def test_a_grammar_refused_in_the_engine_ends_its_request(engine: Engine) -> None:
    bad = Request("bad", prompt(TOK), SamplingParams(
        max_tokens=5, structured=StructuredOutput(StructuredKind.REGEX, "(unclosed")))
    res = Result()
    engine.submit(bad, res.sink())  # not compiled first: the engine loop meets the error
    engine.step()
    assert res.finish == "error" and res.error.startswith("sampling.structured.regex: ")
    assert_clean(engine)


def test_a_model_without_tokenizer_json_refuses_grammars(tmp_path: Path) -> None:
    from tests.worker.conftest import build_tiny_checkpoint

    build_tiny_checkpoint(tmp_path, "llama", max_position_embeddings=64)
    engine = make_engine(path=str(tmp_path), page_size=4, num_pages=64)
    choice = StructuredOutput(StructuredKind.CHOICE, choices=("a",))
    with pytest.raises(GrammarError, match="no tokenizer.json"):
        engine.grammars.compile(choice)  # the server answers INVALID_ARGUMENT with this
    out = Result()
    engine.submit(Request("r", [1, 2, 3], SamplingParams(max_tokens=3, structured=choice)),
                  out.sink())
    engine.step()
    assert out.finish == "error" and "tokenizer.json" in out.error
    assert_clean(engine)
