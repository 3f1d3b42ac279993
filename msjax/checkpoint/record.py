"""A checkpoint's JSON record (config, data position, fingerprints) sealed with a CRC-32.

The seal is the last member of the same JSON object, `"record_crc32": "<8 hex digits>"`, a CRC-32
of every byte before it. CRC-32 detects every single-bit error (and every burst of up to 32
bits), so any one flipped bit in the record, the seal's key or its digits is caught.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

SEAL_KEY = "record_crc32"
_SEAL_PREFIX = b', "' + SEAL_KEY.encode() + b'": "'
_SEAL_SUFFIX = b'"}'
_HEX_DIGITS = frozenset(b"0123456789abcdef")


def seal_record(record: dict[str, Any]) -> bytes:
    """The record as JSON bytes, ending with its CRC-32 seal (record must be a non-empty dict)."""
    body = json.dumps(record, sort_keys=True).encode()
    assert body.endswith(b"}") and body != b"{}", "a record is a non-empty JSON object"
    body = body[:-1] + _SEAL_PREFIX
    return body + f"{zlib.crc32(body):08x}".encode() + _SEAL_SUFFIX


def record_problem(raw: bytes) -> str | None:
    """Why these bytes are not an intact record; None when they are.

    A record without a seal is accepted only as format 1 (written before records were sealed).
    """
    try:
        record = json.loads(raw)
    except ValueError:
        return "its JSON record does not parse"
    if not isinstance(record, dict):
        return "its JSON record is not an object"
    if SEAL_KEY not in record and record.get("format_version") == 1:
        return None
    start = raw.rfind(_SEAL_PREFIX)
    digits = raw[start + len(_SEAL_PREFIX) : -len(_SEAL_SUFFIX)]
    well_formed = (
        start >= 0
        and raw.endswith(_SEAL_SUFFIX)
        and len(digits) == 8
        and set(digits) <= _HEX_DIGITS
    )
    if not well_formed:
        return "its JSON record has no intact seal"
    if int(digits, 16) != zlib.crc32(raw[: start + len(_SEAL_PREFIX)]):
        return "its JSON record does not match its CRC-32 (garbled)"
    return None
