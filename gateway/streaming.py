"""One streamed response's SSE events, written by its request's task or pushed from the
worker's stream.

`StreamEvents.of(output)` turns each worker output of one request into the response's events
(the same bytes whichever way they leave). Once the first events are out and the client's
connection takes direct writes (gateway/http_protocol.py's DirectChunks), the handler hands
`StreamEvents.sink` to the run (`RequestRun.push`): the session's reader then turns each later
output into events and writes them to the client in the pass that splits the worker's step
message, with no wake-up of the request's task, no future and no async-generator step per
token (together a quarter of the gateway's CPU per streamed token). The task wakes only when:

- the output carries the finish reason: refused, the task writes the last events, the usage
  and `[DONE]` as before;
- a stop string or a tool parser ended the output here: ENDED, the task's read returns the
  end, and it finishes the same way (and aborts the worker's request);
- the client is slow (its transport paused) or gone: refused, the output goes through ASGI
  `send`, which waits for the drain; pushing resumes with the next read (a gone client's
  task is cancelled by its watcher);
- the worker's stream fails or stalls, or the sink raises: the task's read raises it.
"""

from __future__ import annotations

import time

from gateway.chat_output import ChatOutput
from gateway.chunks import EMPTY_DELTA, ROLE_DELTA, ChatEvents, CompletionEvents, content_delta
from gateway.http_protocol import DirectChunks
from gateway.metrics import TokenClock
from gateway.openai_responses import UsageCounts
from gateway.output import OutputAssembler
from gateway.session import Output, Push
from gateway.token_bytes import TextOffsets
from protocol import tandem_pb2


class StreamEvents:
    """The events of one streamed /v1/completions or /v1/chat/completions response."""

    __slots__ = ("_out", "_chat_out", "_chat", "_completion", "_clock", "_offsets",
                 "_first_chunk", "_lp_sent", "_ids_sent", "direct")

    def __init__(self, request_id: str, model: str, out: OutputAssembler,
                 chat_out: ChatOutput | None, clock: TokenClock, index: int = 0,
                 created: int | None = None) -> None:
        """`index`: the choice these events are of (n > 1); `created`: the response's time,
        the same on every choice's events."""
        created = int(time.time()) if created is None else created
        self._out = out
        self._chat_out = chat_out
        self._chat = (ChatEvents(f"chatcmpl-{request_id}", created, model, index)
                      if chat_out is not None else None)
        self._completion = (CompletionEvents(f"cmpl-{request_id}", created, model, index)
                            if chat_out is None else None)
        self._clock = clock
        # Completions' logprobs text_offset: the text of every token whose logprob went out, as
        # the non-streamed answer counts it (not the text sent, which a stop string holds).
        self._offsets = TextOffsets()
        self._first_chunk = True  # the first completion chunk carries prompt_token_ids
        # How many of the output's logprobs / token ids are out: the assembler's lists, not
        # each message's, so a held-back token's logprob rides on a later chunk and a token
        # past a stop string (trimmed there) is never sent.
        self._lp_sent = 0
        self._ids_sent = 0
        self.direct: DirectChunks | None = None  # the client's connection, once it started

    def attach(self, direct: DirectChunks) -> None:
        """The response started on a connection that takes direct writes: outputs may be
        pushed from now on."""
        self.direct = direct

    def opening(self) -> list[bytes]:
        """Events before the first output's: chat's role delta."""
        return [self._chat.delta(ROLE_DELTA)] if self._chat is not None else []

    def arrived(self, msg: Output) -> None:
        """Record the inter-token latency of an output (not the first)."""
        self._clock.arrived(len(msg.token_ids))

    def of(self, msg: Output) -> list[bytes]:
        """The events of one output (none when it adds nothing the client sees)."""
        if self._chat is not None:
            return self._chat_events(self._chat, msg)
        assert self._completion is not None
        out = self._out
        text = out.add(msg)
        lp_entries = self._new_logprobs()
        ids = None
        if out.return_token_ids:
            ids, self._ids_sent = out.token_ids[self._ids_sent:], len(out.token_ids)
        events = []
        if text or out.finished or lp_entries or ids:
            lp = out.completion_logprobs(lp_entries, self._offsets) if lp_entries else None
            prompt_ids = out.prompt_ids if ids is not None and self._first_chunk else None
            events.append(self._completion.text(text, out.finish_reason, lp, ids, prompt_ids))
            self._first_chunk = False
        return events

    def _chat_events(self, events: ChatEvents, msg: Output) -> list[bytes]:
        """One output's deltas; the finish reason rides on a last empty delta (as OpenAI sends
        it), logprobs on the first chunk."""
        out, chat_out = self._out, self._chat_out
        assert chat_out is not None
        if chat_out.plain and out.plain and not msg.finish_reason:  # content, no end: one delta
            text = out.add(msg)
            if not text:
                return []  # its logprobs wait for the chunk that carries its text
            chat_out.add_content(text)
            entries = self._new_logprobs()
            lp = out.chat_logprobs(entries) if entries else None
            return [events.delta(content_delta(text), None, lp)]
        piece = chat_out.feed(*out.add_token_pieces(msg, chat_out.per_token))
        if chat_out.stop_now:
            out.stop_early()
        deltas = piece.delta_json()
        if out.finished:
            deltas += chat_out.finish().delta_json()
        finish = chat_out.finish_reason(out.finish_reason)
        if not (deltas or out.finished):
            return []  # its logprobs wait for the chunk that carries its text
        entries = self._new_logprobs()
        lp = out.chat_logprobs(entries) if entries else None
        if finish is not None:
            deltas = [*deltas, EMPTY_DELTA]
        last = len(deltas) - 1
        return [events.delta(d, finish if i == last else None, lp if i == 0 else None)
                for i, d in enumerate(deltas)]

    def _new_logprobs(self) -> list[tandem_pb2.TokenLogprob]:
        """The output's logprobs not sent yet (none when logprobs are off)."""
        if not self._out.want_logprobs:
            return []
        logprobs = self._out.logprobs
        entries, self._lp_sent = logprobs[self._lp_sent:], len(logprobs)
        return entries

    def usage(self, usage: UsageCounts) -> bytes:
        events = self._chat or self._completion
        assert events is not None
        return events.usage(usage)

    def sink(self, msg: Output) -> Push:
        """An output pushed from the worker's stream (Leg.push_to): its events straight to the
        client; refused when it ends the stream or the client cannot take a write now."""
        direct = self.direct
        if msg.finish_reason or direct is None or not direct.writable():
            return Push.REFUSED
        self.arrived(msg)
        events = self.of(msg)
        if events:
            direct.put(b"".join(events))
        return Push.ENDED if self._out.finished else Push.TAKEN
