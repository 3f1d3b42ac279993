"""Documents of text files: `.txt` (one document), `.jsonl` / `.jsonl.gz` and `.parquet` (one
per record), decoded as UTF-8 with each undecodable sequence replaced and counted."""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from msjax.data.progress import report_progress
from msjax.data.tokenizer import INSTALL_HINT
from msjax.errors import MsjaxError

READ_CHUNK_BYTES = 2**20  # a .txt is read and decoded this much at a time, each reported
_REPLACEMENT_UTF8 = b"\xef\xbf\xbd"  # U+FFFD as it appears in the input


# A .txt document is its text in consecutive pieces, each ending after a line end where it
# holds one: a large file is read, decoded and tokenized piece by piece, never as one string.
TextPieces = tuple[str, ...]


def text_documents(path: Path, text_field: str) -> Iterator[tuple[int, str | TextPieces, int]]:
    """(document index, text, undecodable sequences replaced) of each non-empty document."""
    name = path.name.lower()
    if path.stat().st_size == 0:
        raise MsjaxError(f"{path}: empty file; a data source file needs at least one document")
    if name.endswith(".txt"):
        text, replaced = _read_text_file(path)
        records: Iterator[tuple[int, str | TextPieces, int]] = iter([(0, text, replaced)])
    elif name.endswith(".parquet"):
        records = _parquet_records(path, text_field)
    else:
        records = _jsonl_records(path, text_field)
    any_record = False
    for index, text, replaced in records:
        any_record = True
        if text:
            yield index, text, replaced
    if not any_record:
        raise MsjaxError(f"{path}: empty file; a data source file needs at least one document")


def _jsonl_records(path: Path, text_field: str) -> Iterator[tuple[int, str, int]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    index = 0
    with opener(path, "rb") as lines:
        try:
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                decoded, replaced = decode_utf8(line)
                try:
                    record = json.loads(decoded)
                except json.JSONDecodeError:
                    raise MsjaxError(f"{path} line {line_number}: not valid JSON") from None
                if not isinstance(record, dict) or text_field not in record:
                    raise MsjaxError(
                        f"{path} line {line_number}: no field {text_field!r}; set text_field "
                        "of this data source to the field holding the text"
                    )
                text = record[text_field]
                if not isinstance(text, str):
                    raise MsjaxError(
                        f"{path} line {line_number}: field {text_field!r} holds "
                        f"{type(text).__name__}, not text"
                    )
                text, replaced_in_text = _without_surrogates(text)
                yield index, text, replaced + replaced_in_text
                index += 1
        except (gzip.BadGzipFile, EOFError, zlib.error):
            raise MsjaxError(f"{path}: not a readable gzip file") from None


def _parquet_records(path: Path, text_field: str) -> Iterator[tuple[int, str, int]]:
    try:
        import pyarrow.parquet
    except ImportError:
        raise MsjaxError(
            f"{path}: reading .parquet needs the pyarrow package; {INSTALL_HINT}"
        ) from None
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
    except Exception:  # pyarrow raises ArrowInvalid / OSError variants for non-parquet bytes
        raise MsjaxError(f"{path}: not a readable parquet file") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise MsjaxError(
            f"{path}: no column {text_field!r}; set text_field of this data source to one of "
            + ", ".join(columns)
        )
    index = 0
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            replaced = 0
            if value is None:
                value = ""
            elif isinstance(value, bytes):
                value, replaced = decode_utf8(value)
            elif not isinstance(value, str):
                raise MsjaxError(f"{path}: column {text_field!r} holds {type(value).__name__}")
            yield index, value, replaced
            index += 1


def _read_text_file(path: Path) -> tuple[TextPieces, int]:
    """The file's text as decode_utf8 would give it whole, read and decoded a chunk at a time
    (each reported as progress) into pieces of about READ_CHUNK_BYTES; a sequence split between
    two chunks decodes as it would whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces: list[str] = []
    pending, replaced, tail = "", 0, b""
    with path.open("rb") as file:
        while chunk := file.read(READ_CHUNK_BYTES):
            decoded = decoder.decode(chunk)
            # tail: the last 2 bytes before, so a U+FFFD of the input across chunks counts once
            replaced += decoded.count("\ufffd") - (tail + chunk).count(_REPLACEMENT_UTF8)
            tail = chunk[-2:]
            pending += decoded
            cut = pending.rfind("\n") + 1 or (
                len(pending) if len(pending) >= READ_CHUNK_BYTES else 0
            )
            if cut:
                pieces.append(pending[:cut])
                pending = pending[cut:]
            report_progress(len(chunk))
    decoded = decoder.decode(b"", final=True)
    pending += decoded
    if pending:
        pieces.append(pending)
    return tuple(pieces), replaced + decoded.count("\ufffd")


def report_replaced(report: Callable[[str], None], path: Path, replaced: int) -> None:
    """Tell how many undecodable byte sequences of `path` became U+FFFD."""
    report(f"{path}: replaced {replaced} undecodable byte sequences with U+FFFD")


def decode_utf8(raw: bytes) -> tuple[str, int]:
    """UTF-8 text of raw with each undecodable sequence as U+FFFD, and how many were replaced."""
    text = raw.decode("utf-8", errors="replace")
    # U+FFFD already in the input (EF BF BD) decodes to one character each and is not counted.
    return text, text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")


def _without_surrogates(text: str) -> tuple[str, int]:
    """JSON may escape lone surrogates (\\ud800), which no tokenizer can encode: replace them."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        cleaned = text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
        return cleaned, cleaned.count("\ufffd") - text.count("\ufffd")
