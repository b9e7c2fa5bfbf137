"""Stream: one Generate call as an iterator of typed events (Prefill, Token, then Result).

Cancellation: `cancel()` / `close()`, leaving a `with` block, or dropping the last reference
(breaking out of `for event in client.generate(...)` does this) cancels the call; the worker
stops after the current token. A thread still iterating then gets `tandem.Cancelled`.

Not thread-safe except `cancel()`, which may be called from any thread.
"""

import threading
from typing import Any, Iterator, List, Optional, Union

import grpc

from tandem import errors
from tandem.events import (Prefill, Result, Token, prefill_from_proto, result_from_proto,
                           token_from_proto)

Event = Union[Prefill, Token, Result]


class Stream:
    """Iterate it for events; `collect()` drains it and returns the Result."""

    def __init__(self, call: Any):
        self._call = call   # grpc's unary_stream call: an iterator of GenerateResponse
        self._tokens: List[Token] = []
        self._result: Optional[Result] = None
        self._ended = False
        self._cancelled = False
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        if self._ended:
            raise StopIteration
        try:
            msg = next(self._call)
        except StopIteration:
            self._ended = True
            if self._result is None:   # the contract is one `final` before OK
                raise errors.TandemError("the Generate stream ended without its final message",
                                         grpc.StatusCode.INTERNAL) from None
            raise
        except grpc.RpcError as e:
            self._ended = True
            raise errors.from_rpc_error(e) from None
        kind = msg.WhichOneof("event")
        if kind == "token":
            token = token_from_proto(msg.token)
            self._tokens.append(token)
            return token
        if kind == "prefill":
            return prefill_from_proto(msg.prefill)
        if kind == "final":
            self._result = result_from_proto(msg.final, tuple(self._tokens))
            return self._result
        # An event kind added to the proto later: passed on as the raw message.
        return getattr(msg, kind) if kind else msg

    @property
    def result(self) -> Optional[Result]:
        """The Result once the final event was read, else None."""
        return self._result

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def collect(self) -> Result:
        """Reads the rest of the stream; returns its Result. Raises a TandemError on failure."""
        for _ in self:
            pass
        if self._result is None:
            raise errors.Cancelled("the stream was cancelled before its result")
        return self._result

    def cancel(self) -> None:
        """Cancels the call unless it already ended; safe to call more than once."""
        with self._lock:
            if self._ended or self._cancelled:
                return
            self._cancelled = True
        self._call.cancel()

    close = cancel

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()

    def __del__(self) -> None:
        # The interpreter may be tearing down: a failure here has nobody to report to.
        try:
            self.cancel()
        except Exception:  # noqa: BLE001
            pass
