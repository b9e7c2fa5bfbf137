"""Client: tandem's Generation service (a tandem-gpu-worker) over gRPC, and kept sessions.

Thread safety: a Client may be shared by threads (gRPC channels are); each Stream belongs to the
thread iterating it.
"""

from typing import Any, List, Optional, Sequence, Tuple

import grpc

from tandem import errors
from tandem._proto import pb, pb_grpc
from tandem.capacity import Capacity, build_capacity_request, capacity_from_proto
from tandem.events import Result
from tandem.request import Prompt, build_generate_request
from tandem.stream import Stream

Metadata = Sequence[Tuple[str, str]]

# Unary calls (tokenize, detokenize, model_info, capacity, close_session) get this deadline when
# the client has none: a worker that stopped answering must not hang the caller forever. Generate
# streams run as long as the generation unless a timeout is given.
UNARY_DEFAULT_TIMEOUT_S = 60.0
# The worker's default --max_message_bytes: a long prompt's token ids fit in one message.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_UNSET: Any = object()


class Client:
    """A connection to one worker.

    address: "host:port". timeout: seconds each call may take (None: unary calls 60 s, streams
    unbounded); every method takes `timeout=` to override it. metadata: (key, value) pairs sent
    with every call. credentials: grpc.ChannelCredentials for TLS (None: plaintext).
    channel_options: extra grpc channel arguments.
    """

    def __init__(self, address: str, timeout: Optional[float] = None,
                 metadata: Optional[Metadata] = None, *,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 channel_options: Optional[Sequence[Tuple[str, Any]]] = None):
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        options += list(channel_options or ())
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self.address = address
        self.timeout = timeout
        self.metadata = tuple(metadata or ())

    # --- generation -------------------------------------------------------------------------

    def generate(self, prompt: Prompt, *, session_id: Optional[str] = None,
                 timeout: Optional[float] = _UNSET, metadata: Optional[Metadata] = None,
                 **options: Any) -> Stream:
        """Starts a generation; returns a Stream of Prefill, Token and finally Result events.

        prompt: text, or token ids (a list of ints, fed as given). options: GenerateRequest's
        fields by name (max_tokens is required; temperature, top_p, top_k, stop (a str or a
        list), seed, ignore_eos, mode ("gpu", "hybrid", "offload" or "exact"), beta, window,
        sink, selection, select_tokens, dense_layers, logprobs, top_logprobs); None leaves one
        unset. Raises TypeError for an unknown option; the worker's refusals (e.g.
        InvalidArgument) are raised while iterating.
        """
        request = build_generate_request(prompt, session_id, options)
        call = self._stub.Generate(request, timeout=self._timeout(timeout, unary=False),
                                   metadata=self._metadata(metadata))
        return Stream(call)

    def complete(self, prompt: Prompt, **kwargs: Any) -> Result:
        """generate() read to its end: the Result (text, token ids, usage, finish reason, ...)."""
        with self.generate(prompt, **kwargs) as stream:
            return stream.collect()

    # --- tokenizer and model ----------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = False, *,
                 timeout: Optional[float] = _UNSET) -> List[int]:
        """Token ids of `text` with the model's tokenizer (BOS first when add_bos and the
        tokenizer has one)."""
        response = self._unary(self._stub.Tokenize, pb.TokenizeRequest(text=text, add_bos=add_bos),
                               timeout)
        return list(response.token_ids)

    def detokenize(self, token_ids: Sequence[int], *,
                   timeout: Optional[float] = _UNSET) -> str:
        """The text of token ids."""
        response = self._unary(self._stub.Detokenize,
                               pb.DetokenizeRequest(token_ids=list(token_ids)), timeout)
        return response.text

    def model_info(self, *, timeout: Optional[float] = _UNSET) -> Any:
        """The worker's tandem.v1.ModelInfoResponse (model geometry, backend, vocab_size,
        max_context, chat_template, ...), as the protobuf message."""
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def capacity(self, context: int = 0, *, prompt: int = 0, batch: int = 0,
                 mode: Optional[str] = None, window: Optional[int] = None,
                 sink: Optional[int] = None, selection: Optional[str] = None,
                 select_tokens: Optional[int] = None, beta: Optional[float] = None,
                 timeout: Optional[float] = _UNSET) -> Capacity:
        """The worker's memory plan (GetCapacity) for `batch` sequences of `context` positions
        (prompt + generated, all turns; 0 = the worker's max_context), `prompt` of them the
        prompt (0 = all), in `mode` with window / sink / selection / select_tokens / beta as in
        generate() (None: the worker's defaults). Returns a Capacity: per-tier items, fits, why
        and the largest context that fits. Raises InvalidArgument for a bad value (e.g. a
        context above max_context, an unknown mode)."""
        request = build_capacity_request(context, prompt, batch, mode, window, sink, selection,
                                         select_tokens, beta)
        return capacity_from_proto(self._unary(self._stub.GetCapacity, request, timeout))

    # --- sessions ---------------------------------------------------------------------------

    def session(self, session_id: str) -> "Session":
        """A handle on a kept session (created by its first turn; nothing is sent now)."""
        return Session(self, session_id)

    def close_session(self, session_id: str, *, timeout: Optional[float] = _UNSET) -> None:
        """Frees a kept session on the worker. Raises NotFound when it does not exist."""
        self._unary(self._stub.CloseSession,
                    pb.CloseGenerationSessionRequest(session_id=session_id), timeout)

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- helpers ----------------------------------------------------------------------------

    def _timeout(self, timeout: Optional[float], unary: bool) -> Optional[float]:
        if timeout is _UNSET:
            timeout = self.timeout
        if timeout is None and unary:
            return UNARY_DEFAULT_TIMEOUT_S
        return timeout

    def _metadata(self, extra: Optional[Metadata]) -> Optional[Tuple[Tuple[str, str], ...]]:
        merged = self.metadata + tuple(extra or ())
        return merged or None

    def _unary(self, method: Any, request: Any, timeout: Optional[float]) -> Any:
        try:
            return method(request, timeout=self._timeout(timeout, unary=True),
                          metadata=self._metadata(None))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None


class Session:
    """A kept session: each turn continues its KV. As a context manager it is closed on exit
    (a session that never ran a turn does not exist on the worker; closing it then is quiet)."""

    def __init__(self, client: Client, session_id: str):
        self.client = client
        self.id = session_id

    def generate(self, prompt: Prompt, **kwargs: Any) -> Stream:
        """A turn: Client.generate() with this session's id."""
        return self.client.generate(prompt, session_id=self.id, **kwargs)

    def complete(self, prompt: Prompt, **kwargs: Any) -> Result:
        """A turn read to its end."""
        return self.client.complete(prompt, session_id=self.id, **kwargs)

    def close(self) -> None:
        """Frees the session on the worker. Raises NotFound when it does not exist."""
        self.client.close_session(self.id)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        except errors.NotFound:
            pass
