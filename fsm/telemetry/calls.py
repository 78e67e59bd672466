"""The spans of a model or a tool call: current from the call's start to its end, with the flat `done` that
runs once per call of every trajectory (spans.py holds the span they share with the root)."""

from __future__ import annotations

import json
from typing import Any

from opentelemetry.trace import Status, StatusCode

from fsm.telemetry.content import _input_messages, _output_messages
from fsm.telemetry.shapes import _Shapes
from fsm.telemetry.spans import _detach, _Span, _time_ns


class _CallSpan(_Span):
    """A model or tool call, current from its start (`Telemetry.model_call`/`tool_call`) to `done(...)` or
    `fail(exc)`: spans a backend or a tool starts are its children. `values` holds what the start knew
    until `done` lines the values up with the shape."""

    __slots__ = ()

    def fail(self, exc: BaseException) -> None:
        """The call raised: status ERROR, error.type, the exception as an event."""
        _detach(self._token)
        self.values = self._request_values()
        self._fail(exc)
        self.end()

    def _request_values(self) -> tuple:
        return ()


class _ModelSpan(_CallSpan):
    # With content capture on (only then: `Telemetry.model_call` sets it), (tokenizer, the roles of the
    # request's tokens): what `_input_messages` / `_output_messages` decode the call's content with.
    __slots__ = ("_content", "_late")  # `_late`: (shapes, backend) for a span of an unresolved shape
    _content: tuple[Any, list[tuple[str, int]]]  # (tokenizer, `_roles`)
    _late: tuple[_Shapes, Any]

    def _request_values(self) -> tuple:
        request = self.values
        return (
            request.session_id,
            request.sampling_params,
            tuple(request.prompt_ids) if self.tel.capture_content else None,
        )

    def fail(self, exc: BaseException) -> None:
        if self.shape.unresolved:
            shapes, backend = self._late
            self.shape = shapes.model(backend)
        if not self.tel.capture_content:
            return super().fail(exc)
        _detach(self._token)  # with content: what the failed call was asked, as input messages
        request = self.values
        self.values = (*self._request_values(), *(None,) * 9, _input_messages(request, *self._content))
        self._fail(exc)
        self.end()

    def done(self, result: Any) -> None:
        """The backend answered: usage, finish reason, the server that answered; the span ends. (Flat: it
        runs once per model call; what can wait, the sampling parameters and the server's address, is read
        in the export thread.)"""
        _detach(self._token)
        request, tel = self.values, self.tel
        version, extra = result.weight_version, result.extra
        self._end = end = _time_ns()
        if self.shape.unresolved:  # started before the backend knew its model's name: named now
            shapes, backend = self._late
            self.shape = shapes.model(backend)
        if self._extra is None and not tel.capture_content:  # the common case, as a tuple (`_queue`, inlined)
            tel._ended += 1
            tel._emit(
                (
                    self.shape.id,
                    self._trace_id,
                    self._span_id,
                    self._parent_id,
                    self._start,
                    end,
                    request.session_id,
                    request.sampling_params,
                    None,
                    result.finish_reason,
                    len(result.token_ids),
                    result.prompt_tokens,
                    result.cached_tokens,
                    result.server,
                    result.route,
                    None if version is None else str(version),
                    str(extra["id"]) if extra and extra.get("id") else None,
                )
            )
            if len(tel._queue) >= tel._batch:
                tel._wake_exporters()
            return
        content: tuple = (None, None, None)
        if tel.capture_content:  # token ids, and decoded: input and output messages
            tokenizer, roles = self._content
            content = (
                tuple(result.token_ids),
                _input_messages(request, tokenizer, roles),
                _output_messages(result, tokenizer),
            )
        self.values = (
            *self._request_values(),
            result.finish_reason,
            len(result.token_ids),
            result.prompt_tokens,
            result.cached_tokens,
            result.server,
            result.route,
            None if version is None else str(version),
            str(extra["id"]) if extra and extra.get("id") else None,
            *content,
        )
        self._queue()


class _ToolSpan(_CallSpan):
    __slots__ = ()

    def _request_values(self) -> tuple:
        call = self.values
        args = None
        if self.tel.capture_content:
            args = call.raw if call.arguments is None else json.dumps(call.arguments, ensure_ascii=False)
        return (call.id or None, args)

    def done(self, outcome: Any) -> None:
        """The tool call finished (maybe with an error outcome: status ERROR); the span ends."""
        _detach(self._token)
        call, tel = self.values, self.tel
        self._end = end = _time_ns()
        error = outcome.error
        if error is None and self._extra is None and not tel.capture_content:  # `_queue`, inlined
            tel._ended += 1
            tel._emit(
                (
                    self.shape.id,
                    self._trace_id,
                    self._span_id,
                    self._parent_id,
                    self._start,
                    end,
                    call.id or None,
                    None,
                    outcome.attempts,
                )
            )
            if len(tel._queue) >= tel._batch:
                tel._wake_exporters()
            return
        self.values = (
            *self._request_values(),
            outcome.attempts,
            error,
            outcome.text if tel.capture_content else None,
        )
        if error is not None:
            self._x().status = Status(StatusCode.ERROR, outcome.text[:200])
        self._queue()
