"""GetCapacity: the memory plan of a request on one worker (device, host and CPU-node tiers).

The worker sizes a context (prompt + generated tokens, all turns) x batch in a mode with its own
model, flags, device and nodes, and answers per tier what the parts take, whether each fits and
the largest context that would. `Client.capacity()` returns it as a `Capacity`.
"""

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from tandem._proto import pb


@dataclass(frozen=True)
class CapacityItem:
    """One part of an estimate, e.g. "weights", "kv windows", "node KV blocks"."""

    name: str
    bytes: int
    detail: str     # how it is made up, for people


@dataclass(frozen=True)
class CapacityTier:
    """One kind of memory: the device (RAM for the cpu backend), the worker's host RAM, or the
    CPU nodes' pools together."""

    items: Tuple[CapacityItem, ...]
    total_bytes: int       # sum of the items
    capacity_bytes: int    # what there is (device memory, host MemAvailable, node pools)
    fits: bool
    why: str               # when it does not fit: what is short ("" when it fits)

    def item(self, name: str) -> Optional[CapacityItem]:
        """The item named `name`, or None."""
        return next((i for i in self.items if i.name == name), None)


@dataclass(frozen=True)
class Capacity:
    """A worker's answer to GetCapacity."""

    context: int           # the request as sized (defaults filled in)
    prompt: int
    batch: int
    mode: str
    device: CapacityTier
    host: CapacityTier
    nodes: CapacityTier
    node_bytes: Tuple[int, ...]       # projected bytes per CPU node, in node_addresses' order
    node_addresses: Tuple[str, ...]
    fits: bool                        # every tier fits
    largest_context: int              # with this batch, mode and generated tokens; 0: none fits
    text: str                         # the estimate as a table for people
    raw: Any = field(repr=False, compare=False, default=None)

    @property
    def why(self) -> str:
        """What is short, tier by tier ("" when it fits)."""
        return "; ".join(t.why for t in (self.device, self.host, self.nodes) if t.why)


def build_capacity_request(context: int, prompt: int, batch: int, mode: Optional[str],
                           window: Optional[int], sink: Optional[int], selection: Optional[str],
                           select_tokens: Optional[int], beta: Optional[float]) -> Any:
    """Returns a tandem.v1.GetCapacityRequest; None leaves a field at the worker's default.
    Raises TypeError for a value of the wrong type (nothing is sent)."""
    req = pb.GetCapacityRequest()
    values = dict(context=context, prompt=prompt, batch=batch, mode=mode, window=window,
                  sink=sink, selection=selection, select_tokens=select_tokens, beta=beta)
    for name, value in values.items():
        if value is None:
            continue
        try:
            setattr(req, name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"capacity argument '{name}': {e}") from None
    return req


def _tier(msg: Any) -> CapacityTier:
    return CapacityTier(
        items=tuple(CapacityItem(i.name, i.bytes, i.detail) for i in msg.items),
        total_bytes=msg.total_bytes, capacity_bytes=msg.capacity_bytes, fits=msg.fits,
        why=msg.why)


def capacity_from_proto(msg: Any) -> Capacity:
    return Capacity(
        context=msg.context, prompt=msg.prompt, batch=msg.batch, mode=msg.mode,
        device=_tier(msg.device), host=_tier(msg.host), nodes=_tier(msg.nodes),
        node_bytes=tuple(msg.node_bytes), node_addresses=tuple(msg.node_addresses),
        fits=msg.fits, largest_context=msg.largest_context, text=msg.text, raw=msg)
