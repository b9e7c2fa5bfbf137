"""Byte sizes as tandem's flags and Kubernetes' quantities spell them.

parse_byte_size() mirrors tandem::ParseByteSize (common/include/tandem/common/byte_size.h), so
render.py and validate.py read --pool_bytes exactly as the CPU node does. parse_quantity()
reads a Kubernetes resource.Quantity ("9Gi", "9663676416", "10G", "1.5e9") into an exact
Fraction; format_memory() writes bytes back as the shortest exact binary-suffixed quantity.
"""

import math
import re
from fractions import Fraction

# tandem's ByteSize: K/M/G/T are powers of 1024, "B" or "iB" may follow, case-insensitive.
_BYTE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_BYTE_SIZE_MAX = 4.6e18  # byte_size.h rejects values past this (about 2^62)

# Kubernetes quantity suffixes (k8s.io/apimachinery/pkg/api/resource).
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
           "Ei": 1 << 60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
                       r"(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


def parse_byte_size(text):
    """Bytes of a ByteSize flag value like "64GiB", "512M" or "1073741824".

    Raises ValueError with the C++ parser's message for anything it would reject.
    """
    original = text
    s = str(text).strip()

    def strip_suffix(suffix):
        nonlocal s
        if len(s) > len(suffix) and s[-len(suffix):].lower() == suffix.lower():
            s = s[:-len(suffix)]
            return True
        return False

    if not strip_suffix("iB"):
        strip_suffix("B")
    multiplier = 1
    for unit, scale in _BYTE_UNITS.items():
        if strip_suffix(unit):
            multiplier = scale
    try:
        value = float(s)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or value * multiplier > _BYTE_SIZE_MAX:
        raise ValueError(f"'{original}' is not a byte size like 1073741824, 512M or 8GiB")
    return int(value * multiplier)


def parse_quantity(value):
    """Exact Fraction of a Kubernetes quantity given as a string or a YAML number."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a quantity")
        return Fraction(value)
    m = _QUANTITY.match(str(value).strip())
    if m is None:
        raise ValueError(f"'{value}' is not a Kubernetes quantity like 9Gi, 500m or 10G")
    number = Fraction(m.group(1))
    suffix = m.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * Fraction(10) ** int(suffix[1:])  # exponent form, e.g. 1e9


def format_memory(num_bytes):
    """The shortest exact binary quantity for a byte count: 9Gi, 1536Mi, 1000."""
    if num_bytes < 0:
        raise ValueError(f"negative memory size {num_bytes}")
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        scale = _BINARY[suffix]
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{suffix}"
    return str(num_bytes)


def format_gib(num_bytes):
    """A byte count for messages: "9 GiB" or "1.50 GiB"."""
    gib = float(num_bytes) / (1 << 30)
    return f"{gib:.0f} GiB" if gib == int(gib) else f"{gib:.2f} GiB"
