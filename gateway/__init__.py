"""The gateway: OpenAI HTTP API in front of the worker pools. Imports `protocol` only, never torch.

Modules, in the order a request meets them:
  app.py           create_app(config): routes, lifespan (owns the pool), error mapping
  server.py        run_gateway(config): uvicorn (+uvloop), until SIGINT/SIGTERM
  serving.py       one generation request: body → prompt ids → SamplingParams → JSON or SSE
  request_body.py  read the body (size cap, deadline), JSON → pydantic request, 400s by field
  openai_types.py  pydantic request models and value checks (agent_types.py: tools, formats)
  openai_responses.py  response bodies and stream chunks
  agents.py        chat template inputs (tools, kwargs, roles), parsers and constraint per request
  structured.py    response_format / guided_* / structured_outputs -> StructuredOutput
  tokenizer.py     tokenizer.json + chat template (sandboxed jinja2, as transformers renders)
  dispatch.py      mono or PD dispatch of one request, retry before the first token, Abort
  stalls.py        StallWatch (streams gone quiet after the first token), `_timeout`
  waits.py         wait_event: a bounded Event wait that a cancellation always ends
  routing.py       round_robin, least_load, cache_aware (page-hash chain)
  pool.py          channels, GetInfo, health (thresholds), GetLoad refresh
  output.py        token stream → text deltas, finish reason, usage, logprobs
  chat_output.py   reasoning / content / tool-call deltas of a chat answer
  parsers/         reasoning and tool-call parsers, grammars that force a parser's format
  detokenize.py    incremental detokenizer, stop strings across chunks
  sse.py           lean SSE response, client-disconnect watcher
  metrics.py       Prometheus metrics (tandem_*), one registry per app
  errors.py        typed errors → OpenAI-shaped bodies; gRPC status → HTTP status
"""
