"""Byte-level tokenizer: one token per UTF-8 byte plus an end-of-document token."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Tokens 0..255 are bytes, 256 ends a document; the model pads its vocabulary above that."""

    vocab_size: int = 257
    eos_id: int = 256

    def encode(self, text: str | bytes, add_eos: bool = False) -> np.ndarray:
        """Token ids of text (UTF-8 encoded if a str) as a 1-D uint16 array."""
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)  # [len(raw)]
        if add_eos:
            ids = np.append(ids, np.uint16(self.eos_id))
        return ids

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of ids: EOS shows as a newline, undecodable bytes and ids above EOS as U+FFFD."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        eos = ids == self.eos_id
        # 0xFF never occurs in UTF-8, so it decodes to one U+FFFD under errors="replace".
        raw = np.where(eos, ord("\n"), np.where((ids < 0) | (ids > self.eos_id), 0xFF, ids))
        return raw.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
