"""A response object and its event sequence, built from the engine's events.

The same builder serves both forms: a non-streamed answer feeds it every event and keeps only
the final object; a stream sends each event it returns, in order, numbered:

    response.created, response.in_progress
    [reasoning item]  output_item.added, reasoning_summary_part.added,
                      reasoning_summary_text.delta..., .done, reasoning_summary_part.done, output_item.done
    [message item]    output_item.added, content_part.added, output_text.delta..., .done,
                      content_part.done, output_item.done
    [each call]       output_item.added, function_call_arguments.delta, .done, output_item.done
    response.completed | response.incomplete | response.failed
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mlxkv_serve.engine import Delta, Failed, Finished, GenerationHandle, ToolCall
from mlxkv_serve.responses_schema import ToolSet
from mlxkv_serve.state import ServerState
from mlxkv_serve.streaming import failure, sse

Event = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResponseIds:
    response_id: str
    created_at: int
    model: str
    previous_response_id: str | None
    store: bool


class ResponseBuilder:
    def __init__(self, ids: ResponseIds, echo: dict[str, Any], tools: ToolSet) -> None:
        self.ids, self.echo, self.tools = ids, echo, tools
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.incomplete: dict[str, str] | None = None
        self.error: dict[str, str] | None = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written
        self._reasoning_steps = 0

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def delta(self, delta: Delta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            self._reasoning_steps += 1
            if self._open is None or self._open["type"] != "reasoning":
                events += self._close() + self._open_reasoning()
            assert self._open is not None
            self._open["summary"][0]["text"] += delta.reasoning
            events.append(self._event("response.reasoning_summary_text.delta", item_id=self._open["id"],
                                      output_index=self._index(), summary_index=0, delta=delta.reasoning))
        if delta.text:
            if self._open is None or self._open["type"] != "message":
                events += self._close() + self._open_message()
            assert self._open is not None
            self._open["content"][0]["text"] += delta.text
            events.append(self._event("response.output_text.delta", item_id=self._open["id"], output_index=self._index(),
                                      content_index=0, delta=delta.text, logprobs=[]))
        return events

    def finish(self, done: Finished) -> list[Event]:
        events = self._close()
        for call in done.tool_calls:
            events += self._call(call)
        cached = min(done.cached_tokens, done.prompt_tokens)
        reasoning = min(self._reasoning_steps, done.completion_tokens)
        self.usage = {"input_tokens": done.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                      "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                      "total_tokens": done.prompt_tokens + done.completion_tokens}
        if done.finish_reason in ("length", "cancelled"):
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return events + [self._event("response.completed", response=self.response())]

    def fail(self, message: str) -> list[Event]:
        self.status, self.error = "failed", {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self.response())]

    def response(self) -> dict[str, Any]:
        ids = self.ids
        return {"id": ids.response_id, "object": "response", "created_at": ids.created_at, "status": self.status,
                "completed_at": int(time.time()) if self.status == "completed" else None, "error": self.error,
                "incomplete_details": self.incomplete, "model": ids.model, "output": list(self.output),
                "previous_response_id": ids.previous_response_id, "store": ids.store, "usage": self.usage,
                "background": False, **self.echo}

    def _index(self) -> int:
        return len(self.output) - 1

    def _event(self, kind: str, **fields: Any) -> Event:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{self.ids.response_id.removeprefix('resp_')}_{len(self.output)}"

    def _open_reasoning(self) -> list[Event]:
        item = {"id": self._id("rs"), "type": "reasoning", "summary": [{"type": "summary_text", "text": ""}],
                "encrypted_content": None, "status": "in_progress"}
        self._open = item
        self.output.append(item)
        shown = {**item, "summary": []}
        return [self._event("response.output_item.added", output_index=self._index(), item=shown),
                self._event("response.reasoning_summary_part.added", item_id=item["id"], output_index=self._index(),
                            summary_index=0, part={"type": "summary_text", "text": ""})]

    def _open_message(self) -> list[Event]:
        item = {"id": self._id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self._open = item
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=self._index(), item={**item, "content": []}),
                self._event("response.content_part.added", item_id=item["id"], output_index=self._index(), content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close(self) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        if item["type"] == "reasoning":
            text = item["summary"][0]["text"]
            events = [self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                      self._event("response.reasoning_summary_part.done", **where, summary_index=0,
                                  part={"type": "summary_text", "text": text})]
        else:
            part = item["content"][0]
            events = [self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=dict(part))]
        return events + [self._event("response.output_item.done", output_index=where["output_index"], item=dict(item))]

    def _call(self, call: ToolCall) -> list[Event]:
        namespace, name = self.tools.split(call.name)
        item: dict[str, Any] = {"id": self._id("fc"), "type": "function_call", "status": "completed", "call_id": call.id,
                                "name": name, "arguments": call.arguments}
        if namespace is not None:
            item["namespace"] = namespace
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": self._index()}
        return [self._event("response.output_item.added", output_index=self._index(),
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self._event("response.function_call_arguments.done", **where, name=name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=self._index(), item=dict(item))]


async def stream(state: ServerState, handle: GenerationHandle, builder: ResponseBuilder) -> AsyncIterator[str]:
    """The events as SSE frames (`event:` names the type, as OpenAI's do); ends after the final one."""
    for event in builder.start():
        yield sse(event, event["type"])
    async for got in handle.events():
        if isinstance(got, Delta):
            events = builder.delta(got)
        elif isinstance(got, Failed):
            events = builder.fail(failure(state, got).message)
        else:
            state.record(got)
            events = builder.finish(got)
        for event in events:
            yield sse(event, event["type"])
        if not isinstance(got, Delta):
            return
