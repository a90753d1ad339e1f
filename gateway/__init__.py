"""The gateway: OpenAI HTTP API in front of the worker pools. Imports `protocol` only, never torch.

Modules, in the order a request meets them:
  app.py           create_app(config): routes, lifespan (owns the pool), error mapping
  server.py        run_gateway(config): uvicorn (+uvloop), until SIGINT/SIGTERM
  serving.py       one generation request: body → prompt ids → SamplingParams → JSON or SSE
  openai_types.py  pydantic request models and value checks; openai_responses.py: responses
  tokenizer.py     tokenizer.json + chat template (sandboxed jinja2)
  dispatch.py      mono or PD dispatch of one request, retry before the first token, Abort
  routing.py       round_robin, least_load, cache_aware (page-hash chain)
  pool.py          channels, GetInfo, health (thresholds), GetLoad refresh
  output.py        token stream → text deltas, finish reason, usage, logprobs
  detokenize.py    incremental detokenizer, stop strings across chunks
  sse.py           lean SSE response, client-disconnect watcher
  metrics.py       Prometheus metrics (tandem_*), one registry per app
  errors.py        typed errors → OpenAI-shaped bodies; gRPC status → HTTP status
"""
