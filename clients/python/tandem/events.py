"""The events a Generate stream yields, and the result of a whole generation.

A stream yields zero or more `Prefill` (one per prefill chunk), one `Token` per generated token,
then exactly one `Result` (the worker's final message plus the text and ids this client
gathered). Each event keeps the protobuf message it came from in `raw`; a proto field without an
attribute here (added to generation.proto later) is read through to `raw`, so `event.<field>`
works for it too.
"""

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple


class _ReadsThroughToRaw:
    """Attributes this class does not define are read from the protobuf message `raw`."""

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails; `raw` itself missing (mid-construction, copy)
        # must not recurse.
        if name == "raw" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.raw, name)


@dataclass(frozen=True)
class Prefill(_ReadsThroughToRaw):
    """Progress of the prompt's forward pass (one per prefill chunk)."""

    total: int              # prompt tokens this request prefills
    processed: int          # of those, done so far (== total in the last one)
    elapsed_seconds: float  # since the request started on the worker
    raw: Any = field(repr=False, compare=False, default=None)
    type = "prefill"


@dataclass(frozen=True)
class TopLogprob:
    """One candidate token of a step with its log-probability (natural log, <= 0)."""

    id: int
    text: str      # the token decoded alone (U+FFFD for a partial UTF-8 character)
    bytes: bytes   # the token's exact bytes
    logprob: float


@dataclass(frozen=True)
class Token(_ReadsThroughToRaw):
    """One generated token. `text` may be empty while the worker holds back a partial UTF-8
    character or a possible stop string; the texts of all tokens concatenate to the whole text."""

    id: int
    text: str
    index: int                          # 0 for the request's first generated token
    logprob: Optional[float] = None     # set when the request asked for logprobs=True
    top_logprobs: Tuple[TopLogprob, ...] = ()   # top_logprobs=N: the N likeliest, likeliest first
    raw: Any = field(repr=False, compare=False, default=None)
    type = "token"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int       # this request's prompt tokens (this turn only)
    completion_tokens: int   # tokens generated
    total_tokens: int


@dataclass(frozen=True)
class ExactSplit:
    """Mode "exact": how the session's offloaded KV was split between the paths that attend it
    exactly (the planner's choice or the worker's --exact_fetch_share), and the planner's model.
    The shares are fractions of the offloaded entries and sum to 1."""

    fetch_share: float                   # pinned host pages streamed over PCIe
    node_share: float                    # on the CPU nodes, attended densely there
    recompute_share: float               # recomputed from stored activations (KVPR)
    modelled_step_seconds: float         # per decode step, all layers, this split
    modelled_fetch_only_seconds: float   # the same step with every entry fetched
    recompute_pays: bool                 # whether recompute would lower the modelled step
    recompute_reason: str                # why, in words
    host_entries: int                    # per (layer, kv head) at the end: in host pages
    node_entries: int                    # ... and on the CPU nodes


@dataclass(frozen=True)
class Result(_ReadsThroughToRaw):
    """A finished generation: the last event of a stream, and what `complete()` returns."""

    text: str                         # the generated text (the prompt is not repeated)
    token_ids: Tuple[int, ...]        # the generated token ids
    tokens: Tuple[Token, ...] = field(repr=False)  # every Token event (ids, texts, logprobs)
    usage: Usage
    finish_reason: str                # "length", "stop", "eos", "context" or "cancelled"
    time_to_first_token_seconds: float
    mean_token_latency_seconds: float
    p50_token_latency_seconds: float
    p99_token_latency_seconds: float
    total_seconds: float
    degraded: bool                    # some step ran without a CPU node's answer
    degraded_steps: int
    device_kv_entries: int            # KV entries per (layer, kv head) on the device at the end
    cpu_kv_entries: int               # ... and on the CPU nodes
    session_id: str                   # "" for a one-shot request
    mode: str                         # "gpu", "hybrid", "offload" or "exact": the mode that ran
    exact_split: Optional[ExactSplit] = None   # mode "exact" only: the split it followed
    raw: Any = field(repr=False, compare=False, default=None)
    type = "final"


def _finish_reason_name(final: Any) -> str:
    # FINISH_REASON_LENGTH -> "length"; the enum is read from the message's own descriptor so a
    # reason added to the proto later comes out by its name too.
    enum = final.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
    value = enum.values_by_number.get(final.finish_reason)
    if value is None:
        return str(final.finish_reason)
    return value.name.removeprefix("FINISH_REASON_").lower()


def prefill_from_proto(msg: Any) -> Prefill:
    return Prefill(msg.total, msg.processed, msg.elapsed_seconds, raw=msg)


def token_from_proto(msg: Any) -> Token:
    return Token(
        id=msg.token_id,
        text=msg.text,
        index=msg.index,
        logprob=msg.logprob if msg.HasField("logprob") else None,
        top_logprobs=tuple(
            TopLogprob(t.token_id, t.text, t.raw, t.logprob) for t in msg.top_logprobs),
        raw=msg)


def exact_split_from_proto(msg: Any) -> ExactSplit:
    return ExactSplit(
        fetch_share=msg.fetch_share, node_share=msg.node_share,
        recompute_share=msg.recompute_share, modelled_step_seconds=msg.modelled_step_seconds,
        modelled_fetch_only_seconds=msg.modelled_fetch_only_seconds,
        recompute_pays=msg.recompute_pays, recompute_reason=msg.recompute_reason,
        host_entries=msg.host_entries, node_entries=msg.node_entries)


def result_from_proto(final: Any, tokens: Tuple[Token, ...]) -> Result:
    u = final.usage
    return Result(
        text="".join(t.text for t in tokens),
        token_ids=tuple(t.id for t in tokens),
        tokens=tokens,
        usage=Usage(u.prompt_tokens, u.completion_tokens, u.total_tokens),
        finish_reason=_finish_reason_name(final),
        time_to_first_token_seconds=final.time_to_first_token_seconds,
        mean_token_latency_seconds=final.mean_token_latency_seconds,
        p50_token_latency_seconds=final.p50_token_latency_seconds,
        p99_token_latency_seconds=final.p99_token_latency_seconds,
        total_seconds=final.total_seconds,
        degraded=final.degraded,
        degraded_steps=final.degraded_steps,
        device_kv_entries=final.device_kv_entries,
        cpu_kv_entries=final.cpu_kv_entries,
        session_id=final.session_id,
        mode=final.mode,
        exact_split=(exact_split_from_proto(final.exact_split)
                     if final.HasField("exact_split") else None),
        raw=final)
