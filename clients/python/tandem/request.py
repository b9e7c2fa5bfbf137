"""GenerateRequest from Python arguments: the prompt plus options named as the proto's fields.

Options are matched against GenerateRequest's descriptor, so a field added to generation.proto
is accepted as an option without a change here; an unknown name is a TypeError naming it.
"""

from collections.abc import Sequence
from typing import Any, Mapping, Optional, Union

from google.protobuf.descriptor import FieldDescriptor

from tandem._proto import pb

Prompt = Union[str, Sequence]

# Fields set from generate()'s own arguments, not from **options.
_RESERVED = frozenset({"prompt_text", "prompt_ids", "session_id"})


def build_generate_request(prompt: Prompt, session_id: Optional[str],
                           options: Mapping[str, Any]) -> Any:
    """Returns a tandem.v1.GenerateRequest. `prompt` is text (str) or token ids (a sequence of
    ints, fed as given: no BOS added). An option set to None is left unset (the worker's
    default). Raises TypeError / ValueError for a bad argument (nothing is sent)."""
    req = pb.GenerateRequest(session_id=session_id or "")
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        try:
            req.prompt_ids.ids.extend(prompt)
        except (TypeError, ValueError) as e:
            raise TypeError(f"prompt ids must be ints: {e}") from None
    else:
        raise TypeError(
            f"prompt must be text (str) or token ids (a list of ints), not {type(prompt).__name__}")

    fields = req.DESCRIPTOR.fields_by_name
    for name, value in options.items():
        if name in _RESERVED or name not in fields:
            known = ", ".join(sorted(set(fields) - _RESERVED))
            raise TypeError(f"unknown generate option '{name}' (GenerateRequest has: {known})")
        if value is None:
            continue
        fd = fields[name]
        try:
            if fd.label == FieldDescriptor.LABEL_REPEATED:
                getattr(req, name).extend([value] if isinstance(value, str) else value)
            elif fd.message_type is not None:
                getattr(req, name).CopyFrom(value)
            else:
                setattr(req, name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"generate option '{name}': {e}") from None
    return req
