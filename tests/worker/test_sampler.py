"""The batched sampler: greedy, truncation masks, seeded reproducibility, min_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from worker.sampler import Sampler, make_generator, skip_draw
from worker.sampling import SamplingParams, SamplingParamsError

V = 50
EOS = (3,)


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int | None] | None = None,
    history: list[list[int]] | None = None,
):  # noqa: ANN201
    b = logits.shape[0]
    seeds = seeds or [None] * b
    history = history or [[] for _ in range(b)]
    return Sampler().sample(
        logits, params, [make_generator(s) for s in seeds], history, [len(h) for h in history], EOS
    )


def test_greedy_is_argmax_exactly() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    assert run(logits, [greedy] * 6).token_ids == logits.argmax(-1).tolist()
    # The slow path (a neighbour asks for logprobs) gives the same greedy tokens.
    mixed = run(logits, [greedy] * 5 + [SamplingParams(temperature=0.0, logprobs=True)])
    assert mixed.token_ids == logits.argmax(-1).tolist()



def test_a_temperature_below_the_greedy_bound_is_argmax_not_nan() -> None:
    """1e-45 (a float32 denormal) from any client, not only the gateway's (which sends 0):
    logits over it overflowed and the softmax gave NaN. Below 1e-5 the worker is greedy."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    tiny = [SamplingParams(temperature=t) for t in (1e-45, 1e-38, 9.9e-6, 0.0)]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=2e-5).greedy
    assert run(logits, tiny).token_ids == logits.argmax(-1).tolist()

def _support(logits: torch.Tensor, p: SamplingParams, draws: int = 300) -> set[int]:
    gen = torch.Generator().manual_seed(1)
    sampler = Sampler()
    return {sampler.sample(logits, [p], [gen], [[]], [0], EOS).token_ids[0] for _ in range(draws)}


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * (V - 5)])
    logits = probs.clamp_min(1e-12).log()
    assert _support(logits, SamplingParams(top_k=2)) == {0, 1}
    assert _support(logits, SamplingParams(top_p=0.65)) == {0, 1}  # 0.4 < 0.65 <= 0.7
    assert _support(logits, SamplingParams(top_p=0.75)) == {0, 1, 2}
    assert _support(logits, SamplingParams(min_p=0.3)) == {0, 1, 2}  # >= 0.3 * 0.4 = 0.12
    assert _support(logits, SamplingParams(top_k=4, min_p=0.3)) == {0, 1, 2}
    assert _support(logits, SamplingParams()) == {0, 1, 2, 3, 4}  # all off: full distribution


def test_seeded_samples_do_not_depend_on_batch_composition() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in (11, 12, 13, 14)]
    together = run(logits, params, seeds=[11, 12, 13, 14]).token_ids
    reordered = run(
        logits[[2, 0, 3, 1]], [params[i] for i in (2, 0, 3, 1)], seeds=[13, 11, 14, 12]
    ).token_ids
    alone = [
        run(logits[i : i + 1], [params[i]], seeds=[params[i].seed]).token_ids[0] for i in range(4)
    ]
    with_greedy = run(
        torch.cat([logits[:1] * 3, logits]),
        [SamplingParams(temperature=0.0)] + params,
        seeds=[None, 11, 12, 13, 14],
    ).token_ids[1:]
    assert together == alone == [reordered[i] for i in (1, 3, 0, 2)] == with_greedy

    # Different seeds give different streams (a sequence, so a chance collision cannot pass).
    def stream(seed: int) -> list[int]:
        g = make_generator(seed)
        p = SamplingParams(temperature=1.0, seed=seed)
        return [
            Sampler().sample(logits[:1], [p], [g], [[]], [0], EOS).token_ids[0] for _ in range(20)
        ]

    assert stream(5) == stream(5) and stream(5) != stream(6)


def _stream(seed: int, device: str = "cpu", n: int = 24) -> list[int]:
    """n tokens drawn from a flat distribution with the seed's generator."""
    g = make_generator(seed, device)
    p = SamplingParams(temperature=1.0, seed=seed)
    flat = torch.zeros(1, V, device=device)
    return [Sampler().sample(flat, [p], [g], [[]], [0], EOS).token_ids[0] for _ in range(n)]


# Seeds that differ only above bit 31, or only in bit 63 (a negative seed's two's complement).
HIGH_SEEDS = (2**62, 2**63, 2**32 + 5, 5, 2**64 - 1, 2**32 - 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_seeds_differing_above_bit_31_draw_different_streams(device: str) -> None:
    """torch's CPU generator keeps only a seed's low 32 bits: 2**62 and 2**63 drew the same
    tokens. make_generator folds the high bits in, on every device; the same seed still
    draws the same stream, and a seed below 2**32 keeps torch's own stream."""
    streams = [_stream(s, device) for s in HIGH_SEEDS]
    assert len({tuple(t) for t in streams}) == len(HIGH_SEEDS)
    assert _stream(2**63 + 9, device) == _stream(2**63 + 9, device)
    torch_own = torch.Generator(device=device).manual_seed(77)
    flat = torch.zeros(1, V, device=device)
    p = SamplingParams(temperature=1.0, seed=77)
    want = [Sampler().sample(flat, [p], [torch_own], [[]], [0], EOS).token_ids[0]
            for _ in range(24)]
    assert _stream(77, device) == want


def test_skip_draw_with_a_high_seed() -> None:
    """A decode worker's generator for a seed past 32 bits skips prefill's draw as for any."""
    g = make_generator(2**63 + 3)
    assert g is not None
    skip_draw(g, V)
    assert _stream(2**63 + 3)[1:] == [_draw(g) for _ in range(23)]


def _draw(g: torch.Generator) -> int:
    p = SamplingParams(temperature=1.0, seed=1)
    return Sampler().sample(torch.zeros(1, V), [p], [g], [[]], [0], EOS).token_ids[0]


def _skip_draw_matches(device: str, vocab: int, top_k: int) -> None:
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)).to(device) * 3
    p = SamplingParams(temperature=1.0, seed=9, top_k=top_k)

    def draws(g: torch.Generator, rows: torch.Tensor) -> list[int]:
        return [Sampler().sample(r[None], [p], [g], [[]], [0], EOS).token_ids[0] for r in rows]

    mono = draws(make_generator(9, device), logits)  # type: ignore[arg-type]
    decode = make_generator(9, device)
    assert decode is not None
    skip_draw(decode, vocab)
    assert draws(decode, logits[1:]) == mono[1:]


@pytest.mark.parametrize("top_k", [0, 5])
def test_skip_draw_takes_exactly_one_tokens_randomness(top_k: int) -> None:
    """A decode worker skips the draw prefill made for the first token: what it draws next is
    what one generator drawing every token gives as the second token, whatever the row held."""
    _skip_draw_matches("cpu", V, top_k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_k", [0, 20])
def test_skip_draw_on_cuda_generators(top_k: int) -> None:
    """The same on CUDA generators and a real vocabulary (Philox offsets by the row's size)."""
    _skip_draw_matches("cuda", 151936, top_k)



def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 7], logits[0, 9] = 10.0, 9.0, 8.0  # eos, stop id, ordinary
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert run(logits, [p], history=[[1]]).token_ids == [9]  # 1 generated < 2: eos and 7 banned
    assert run(logits, [p], history=[[1, 1]]).token_ids == [3]  # reached: eos allowed again
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    assert run(logits, [ignore], history=[[1]]).token_ids == [3]  # eos is an ordinary token


def test_penalties_change_the_choice() -> None:
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 5] = 2.0, 1.5
    hist = [[4, 4]]
    assert run(logits, [SamplingParams(temperature=0.0)], history=hist).token_ids == [4]
    assert run(
        logits, [SamplingParams(temperature=0.0, repetition_penalty=1.5)], history=hist
    ).token_ids == [5]
    assert run(
        logits, [SamplingParams(temperature=0.0, presence_penalty=0.6)], history=hist
    ).token_ids == [5]
    assert run(
        logits, [SamplingParams(temperature=0.0, frequency_penalty=0.3)], history=hist
    ).token_ids == [5]
    assert run(
        logits, [SamplingParams(temperature=0.0, frequency_penalty=0.2)], history=hist
    ).token_ids == [4]


def test_logprobs_match_log_softmax_and_top_n_is_sorted() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.7, logprobs=True, seed=1),  # pre-temperature logprobs
        SamplingParams(temperature=0.0),
    ]
    out = run(logits, params, seeds=[None, 1, None])
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-6)
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert top[0][0] == out.token_ids[0] and out.top_logprobs[1] == [] and out.top_logprobs[2] == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_k", -1),
        ("top_p", 0.0),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", 99),
        ("top_logprobs", 21),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("stop_token_ids", (-1,)),
        ("seed", -1),
    ],
)
def test_validate_names_the_field(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError, match=f"sampling.{field}") as err:
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]
    assert err.value.field == field
    SamplingParams().validate()  # defaults are valid


def test_from_proto_resolves_wire_defaults() -> None:
    from protocol import tandem_pb2

    msg = tandem_pb2.SamplingParams(
        temperature=0.0, top_k=-1, max_tokens=8, stop_token_ids=[4], seed=9
    )
    p = SamplingParams.from_proto(msg)
    assert (p.top_k, p.top_p, p.repetition_penalty, p.seed, p.stop_token_ids) == (
        0,
        1.0,
        1.0,
        9,
        (4,),
    )
    assert SamplingParams.from_proto(tandem_pb2.SamplingParams(max_tokens=1)).seed is None
    p.validate()


def test_from_proto_reads_logit_bias_and_structured() -> None:
    from protocol import tandem_pb2
    from worker.sampling import StructuredKind, StructuredOutput

    msg = tandem_pb2.SamplingParams(
        max_tokens=4,
        logit_bias={7: -2.5, 3: 1.0},
        structured=tandem_pb2.StructuredOutput(regex="a+"),
    )
    p = SamplingParams.from_proto(msg)
    assert p.logit_bias == ((3, 1.0), (7, -2.5))  # sorted: equal requests, equal params
    assert p.structured == StructuredOutput(StructuredKind.REGEX, "a+")
    assert p.structured.field == "structured.regex"
    choice = tandem_pb2.StructuredOutput(choice=tandem_pb2.ChoiceList(choices=["x", "y"]))
    q = SamplingParams.from_proto(tandem_pb2.SamplingParams(max_tokens=1, structured=choice))
    assert q.structured == StructuredOutput(StructuredKind.CHOICE, choices=("x", "y"))
    assert SamplingParams.from_proto(tandem_pb2.SamplingParams(max_tokens=1)).structured is None
    obj = tandem_pb2.StructuredOutput(json_object=True)
    r = SamplingParams.from_proto(tandem_pb2.SamplingParams(max_tokens=1, structured=obj))
    assert r.structured == StructuredOutput(StructuredKind.JSON_OBJECT)
    for bad in (
        SamplingParams(logit_bias=((1, float("nan")),)),
        SamplingParams(logit_bias=((-1, 1.0),)),
        SamplingParams(structured=StructuredOutput(StructuredKind.EBNF, "  ")),
    ):
        with pytest.raises(SamplingParamsError):
            bad.validate()
