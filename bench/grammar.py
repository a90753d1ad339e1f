"""Grammar cost per decode step: constrained vs unconstrained, at batch 1 and 64.

Two sections, every compared figure from one process:

1. `sampler` — the sampling work of one decode step alone, at a real vocabulary size: a
   byte-level BPE trained in seconds on this Python's standard library (~120k tokens, cached
   in the temp dir), random logits [B, V] on the device. Unconstrained = `Sampler.sample`;
   constrained = fill the bitmask (worker/grammar_xgr.py `token_mask`: each matcher, or
   xgrammar's batch filler) + copy/apply it + sample + advance every matcher. Grammar: a
   tool-call-like JSON schema; a matcher that finishes is replaced by a fresh one (a new
   request). With llguidance installed (`pip install llguidance`), its mask fill for the
   same schema and vocabulary is timed beside xgrammar's.
2. `engine` — whole decode steps through `worker.engine.Engine`: on CPU the embedded model
   (vocab 128), on CUDA the qwen3-8b shape with dummy weights (bf16, CUDA graphs; unconstrained
   steps also overlap) and the BPE as its tokenizer. B requests decode `--steps` tokens under a
   long JSON schema (an array of objects) or unconstrained; ms per step from the first token on.

    python -m bench.grammar                       # this CPU
    python -m bench.grammar --device cuda         # an H200: the same table, on the GPU
    python -m bench.grammar --sections sampler --batches 1,8,64

Prints a table last and writes grammar.json to --out (default $OUT, else the current dir).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from worker.engine import Engine, RequestOutput  # noqa: E402
from worker.grammar_xgr import GrammarBackend, token_mask, tokenizer_info  # noqa: E402
from worker.request import Request  # noqa: E402
from worker.sampler import Sampler  # noqa: E402
from worker.sampling import SamplingParams, StructuredKind, StructuredOutput  # noqa: E402

EMBEDDED = ROOT / "models" / "tandem-arith"
SHAPE_8B = ROOT / "bench" / "models" / "qwen3-8b-shape"
TOOL_CALL = {"type": "object", "properties": {
    "name": {"enum": ["get_weather", "search", "lookup", "book_flight"]},
    "arguments": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "include": {"type": "array", "items": {"enum": ["wind", "rain", "uv", "pollen"]},
                    "maxItems": 4}},
        "required": ["city", "days", "units", "include"]},
    "reason": {"type": "string", "maxLength": 64}},
    "required": ["name", "arguments", "reason"]}
# The same without length bounds on its strings: xgrammar compiles and masks bounded strings
# on a path of their own (0.2.8 was ~100x slower there, docs/benchmarks.md): both are measured.
TOOL_CALL_FREE = json.loads(json.dumps(TOOL_CALL).replace(', "maxLength": 24', "")
                            .replace(', "maxLength": 64', ""))
SCHEMAS = {"tool_call": TOOL_CALL, "tool_call_free": TOOL_CALL_FREE}
# Long enough for any --steps: an array of up to 1000 small objects.
LONG = {"type": "array", "maxItems": 1000, "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "tag": {"enum": ["alpha", "beta", "gamma"]},
    "note": {"type": "string", "maxLength": 12}}, "required": ["id", "tag", "note"]}}


# ---- the vocabulary ---------------------------------------------------------------------------
def bpe_tokenizer(target: int) -> Path:
    """A byte-level BPE (GPT-2/Qwen style) trained on the standard library's sources: real
    merges, real token strings, no download. Cached: a second run loads it."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(tempfile.gettempdir()) / f"tandem-bench-bpe-{target}.json"
    if path.is_file():
        return path
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.rglob("*.py"))
             if "site-packages" not in p.parts]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(vocab_size=target, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- 1. the sampler alone ---------------------------------------------------------------------
def sampler_section(device: torch.device, batches: list[int], steps: int,
                    tok_path: Path) -> list[dict[str, Any]]:
    from tokenizers import Tokenizer

    text = tok_path.read_text()
    eos = 0  # <|endoftext|>
    # Rows padded to a multiple of 128, as checkpoints pad their embedding (the mask covers them).
    vocab = -(-Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True) // 128) * 128
    t = time.perf_counter()
    backend = GrammarBackend(tokenizer_info(text, vocab, [eos]))
    print(f"sampler: vocab {vocab}, tokenizer info in {(time.perf_counter() - t) * 1e3:.0f} ms",
          flush=True)
    rows = []
    for name, spec in SCHEMAS.items():
        schema = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(spec))
        t = time.perf_counter()
        backend.compile(schema)
        compile_ms = (time.perf_counter() - t) * 1e3
        for b in batches:
            row = {"section": "sampler", "grammar": name, "device": device.type, "batch": b,
                   "vocab": vocab, "compile_ms": compile_ms,
                   **sampler_batch(backend, schema, device, b, steps, vocab, eos)}
            row.update(llguidance_fill(text, spec, vocab, eos, b, steps))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def sampler_batch(backend: GrammarBackend, schema: StructuredOutput, device: torch.device,
                  b: int, steps: int, vocab: int, eos: int) -> dict[str, float]:
    sampler = Sampler()
    logits_pool = [torch.randn(b, vocab, device=device) for _ in range(8)]  # [B, V] each
    params = [SamplingParams(temperature=0.0, max_tokens=1 << 20)] * b
    gens: list[torch.Generator | None] = [None] * b
    empty: list[list[int]] = [[] for _ in range(b)]

    def plain(i: int) -> None:
        out = sampler.sample(logits_pool[i % 8], params, gens, empty, [0] * b, (eos,))
        assert len(out.token_ids) == b

    grammars = [backend.matcher(f"r{i}", schema, [eos]) for i in range(b)]
    history: list[list[int]] = [[] for _ in range(b)]
    parts: dict[str, list[float]] = {"fill": [], "apply_sample": [], "accept": []}

    def constrained(i: int) -> None:
        t0 = time.perf_counter()
        mask = token_mask(grammars, history, empty)
        t1 = time.perf_counter()
        out = sampler.sample(logits_pool[i % 8], params, gens, history, [0] * b, (eos,), mask)
        t2 = time.perf_counter()
        for r, token in enumerate(out.token_ids):
            g = grammars[r]
            if token == eos or g.terminated:  # done: the next request takes the row
                g.close()
                grammars[r] = backend.matcher(f"r{i}-{r}", schema, [eos])
                history[r] = []
            else:
                g.accept(token)
                history[r].append(token)
        parts["fill"].append(t1 - t0)
        parts["apply_sample"].append(t2 - t1)
        parts["accept"].append(time.perf_counter() - t2)

    base = per_call(plain, steps, device)
    cons = per_call(constrained, steps, device)
    for g in grammars:
        g.close()
    return {"unconstrained_ms": base * 1e3, "constrained_ms": cons * 1e3,
            "grammar_ms": (cons - base) * 1e3,
            **{f"{k}_ms": statistics.median(v[1:]) * 1e3 for k, v in parts.items()}}


def per_call(fn: Callable[[int], None], steps: int, device: torch.device) -> float:
    """Median seconds per call over `steps` calls after one warm-up (the device synced): the
    median, because this machine is shared and a mean takes in other processes' bursts."""
    fn(0)
    times = []
    for i in range(steps):
        sync(device)
        t = time.perf_counter()
        fn(i + 1)
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def llguidance_fill(tokenizer_json: str, schema: dict[str, Any], vocab: int, eos: int,
                    batch: int, steps: int) -> dict[str, float]:
    """llguidance's mask fill for the same schema (compact JSON), one executor for the batch."""
    try:
        import llguidance
        import llguidance.torch as llt
    except ImportError:
        return {}
    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    init_s = time.perf_counter() - t
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), overrides={"whitespace_flexible": False})
    t = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar, log_level=0) for _ in range(batch)]
    compile_s = (time.perf_counter() - t) / batch
    executor = llguidance.LLExecutor()
    bitmask = llt.allocate_token_bitmask(batch, vocab)
    rng = random.Random(0)
    fills = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        fills.append(time.perf_counter() - t)
        for i, m in enumerate(matchers):
            words = bitmask[i].tolist()
            allowed = [w * 32 + j for w, bits in enumerate(words) for j in range(32)
                       if (bits >> j) & 1 and w * 32 + j < vocab]
            token = rng.choice(allowed)
            if token == eos or m.is_stopped() or not m.consume_token(token):
                matchers[i] = llguidance.LLMatcher(lltok, grammar, log_level=0)
    return {"llguidance_fill_ms": statistics.median(fills[1:]) * 1e3,
            "llguidance_tokenizer_s": init_s, "llguidance_grammar_ms": compile_s * 1e3}


# ---- 2. whole engine steps --------------------------------------------------------------------
def engine_model(device: torch.device, tok_path: Path, work: Path) -> tuple[Path, Any, Any]:
    """(model dir, dtype, load format): the embedded model on CPU; the 8B shape on CUDA with
    the BPE as its tokenizer (its vocabulary fits in the shape's 151,936 rows)."""
    if device.type != "cuda":
        return EMBEDDED, "float32", "auto"
    dst = work / "qwen3-8b-bpe"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(SHAPE_8B / name, dst / name)
    shutil.copy(tok_path, dst / "tokenizer.json")
    return dst, "bfloat16", "dummy"


def decode_ms(engine: Engine, batch: int, steps: int, structured: StructuredOutput | None,
              vocab: int) -> float:
    """ms per decode step once every request has its first token: the median step (on the
    device, steps keep pace with it: an overlapped step returns as the device takes the next)."""
    first: set[str] = set()
    done: set[str] = set()

    def sink_for(rid: str) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:
            if out.error:
                raise RuntimeError(out.error)
            if out.token_ids:
                first.add(rid)
            if out.finished:
                done.add(rid)
        return sink

    rng = random.Random(batch)
    tag = random.random()
    if structured is not None:
        engine.grammars.compile(structured)
    for i in range(batch):
        rid = f"g{i}-{tag}"
        prompt = [rng.randrange(8, min(vocab, 100)) for _ in range(32)]
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True,
                                structured=structured)
        engine.submit(Request(rid, prompt, params), sink_for(rid))
    while len(first) < batch:
        engine.step()
    sync(engine.device)
    times = []
    while len(done) < batch:
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    sync(engine.device)
    return statistics.median(times) * 1e3


def engine_section(device: torch.device, batches: list[int], steps: int,
                   tok_path: Path) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path, dtype, load_format = engine_model(device, tok_path, Path(tmp))
        config = WorkerConfig(
            model=ModelConfig(path=str(path), dtype=dtype, max_model_len=2048,
                              load_format=load_format),  # type: ignore[arg-type]
            cache=CacheConfig(page_size=16, max_total_tokens=max(batches) * (64 + steps) * 2),
            scheduler=SchedulerConfig(max_num_seqs=max(batches), chunked_prefill_size=4096),
            parallel=ParallelConfig(device=device.type),
            num_threads=torch.get_num_threads(),
        )
        engine = Engine(config)
        engine.warm_up()
        vocab = engine.spec.vocab_size
        long = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(LONG))
        rows = []
        for b in batches:
            decode_ms(engine, b, 4, None, vocab)  # warm this batch size
            base = decode_ms(engine, b, steps, None, vocab)
            cons = decode_ms(engine, b, steps, long, vocab)
            row = {"section": "engine", "grammar": "long_array", "device": device.type,
                   "batch": b, "model": path.name,
                   "vocab": vocab, "unconstrained_ms": base, "constrained_ms": cons,
                   "grammar_ms": cons - base, "overlap": engine.overlap}
            rows.append(row)
            print(json.dumps(row), flush=True)
        assert engine.grammars.num_live == 0
        engine.close()
        return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| section | grammar | device | batch | vocab | unconstrained ms/step | "
            "constrained ms/step | grammar ms/step | fill | apply+sample | accept | "
            "llguidance fill |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        def ms(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.3f}" if key in r else "-"
        lines.append(f"| {r['section']} | {r['grammar']} | {r['device']} | {r['batch']} | "
                     f"{r['vocab']} | "
                     f"{ms('unconstrained_ms')} | {ms('constrained_ms')} | {ms('grammar_ms')} | "
                     f"{ms('fill_ms')} | {ms('apply_sample_ms')} | {ms('accept_ms')} | "
                     f"{ms('llguidance_fill_ms')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128000, help="BPE training target")
    parser.add_argument("--sections", default="sampler,engine")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1, as the default cluster's workers run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    t = time.perf_counter()
    tok_path = bpe_tokenizer(args.vocab)
    print(f"BPE tokenizer ready in {time.perf_counter() - t:.1f} s: {tok_path}", flush=True)
    rows: list[dict[str, Any]] = []
    sections = args.sections.split(",")
    if "sampler" in sections:
        rows += sampler_section(device, batches, args.steps, tok_path)
    if "engine" in sections:
        rows += engine_section(device, batches, args.steps, tok_path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
