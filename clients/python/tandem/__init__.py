"""tandem: Python client of tandem's Generation service (tandem-gpu-worker, gRPC).

    import tandem
    client = tandem.Client("localhost:50051")
    for event in client.generate("Once upon a time", max_tokens=32):
        if isinstance(event, tandem.Token):
            print(event.text, end="", flush=True)

See clients/python/README.md. The protobuf stubs are the subpackage tandem.v1, generated at build
time into build/clients/python/tandem/v1; put both clients/python and build/clients/python on
PYTHONPATH.
"""

import pkgutil

# The generated tandem.v1 lives in another directory named `tandem` (the build tree): join every
# such directory on sys.path to this package so `tandem.v1` is found there.
__path__ = pkgutil.extend_path(__path__, __name__)

from tandem.errors import (Cancelled, DeadlineExceeded, FailedPrecondition, Internal,  # noqa: E402
                           InvalidArgument, NotFound, ResourceExhausted, TandemError, Unavailable)
from tandem.events import ExactSplit, Prefill, Result, Token, TopLogprob, Usage  # noqa: E402
from tandem.capacity import Capacity, CapacityItem, CapacityTier  # noqa: E402
from tandem.client import Client, Session  # noqa: E402
from tandem.stream import Stream  # noqa: E402

__all__ = [
    "Client", "Session", "Stream",
    "Prefill", "Token", "TopLogprob", "Usage", "Result", "ExactSplit",
    "Capacity", "CapacityTier", "CapacityItem",
    "TandemError", "InvalidArgument", "NotFound", "FailedPrecondition", "ResourceExhausted",
    "Unavailable", "Cancelled", "DeadlineExceeded", "Internal",
]
