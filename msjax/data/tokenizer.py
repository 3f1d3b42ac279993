"""Tokenizers behind one protocol: bytes, a SentencePiece `.model`, a Hugging Face `tokenizer.json`.

`load_tokenizer` turns the `data.tokenizer` setting into one; the optional packages load lazily.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from msjax.errors import MsjaxError

INSTALL_HINT = "pip install 'msjax[data]'"
# End-of-text tokens of common tokenizer.json files, most usual first.
_HF_EOS_TOKENS = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[EOS]", "<|eos|>")


class Tokenizer(Protocol):
    """Text to token ids and back; `name` identifies the exact vocabulary in cache keys."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of text as a 1-D unsigned array, no EOS appended."""
        ...

    def decode(self, ids: Any) -> str:
        """Text of ids."""
        ...


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype name that holds every id below vocab_size."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class ByteTokenizer:
    """Tokens 0..255 are bytes, 256 ends a document; the model pads its vocabulary above that."""

    name: str = "byte"
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


class SentencePieceTokenizer:
    """A SentencePiece model; its own eos_id() ends documents."""

    def __init__(self, model_bytes: bytes, path: Path):
        import sentencepiece

        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError:
            raise MsjaxError(_neither_format(path)) from None
        self.name = "sentencepiece:" + hashlib.sha256(model_bytes).hexdigest()
        self.vocab_size = int(self._processor.get_piece_size())
        self.eos_id = int(self._processor.eos_id())
        if self.eos_id < 0:
            raise MsjaxError(
                f"data.tokenizer={path} is a SentencePiece model without an end-of-sentence "
                "token; train it with eos_id set (e.g. --eos_id=2)"
            )
        self._dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._processor.encode(text, out_type=int), dtype=self._dtype)

    def decode(self, ids: Any) -> str:
        return self._processor.decode([int(i) for i in np.asarray(ids).reshape(-1)])


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json; special tokens are never added by encode."""

    def __init__(self, json_bytes: bytes, path: Path):
        import tokenizers

        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(json_bytes.decode("utf-8"))
        except Exception:  # tokenizers raises a bare Exception for malformed files
            raise MsjaxError(_neither_format(path)) from None
        self.name = "huggingface:" + hashlib.sha256(json_bytes).hexdigest()
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        candidates = [
            (token, self._tokenizer.token_to_id(token))
            for token in _HF_EOS_TOKENS
            if self._tokenizer.token_to_id(token) is not None
        ]
        if not candidates:
            raise MsjaxError(
                f"data.tokenizer={path} has no end-of-text token; add one of "
                + ", ".join(_HF_EOS_TOKENS)
                + " as a special token"
            )
        self.eos_token, self.eos_id = candidates[0][0], int(candidates[0][1])
        self._dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=self._dtype)

    def decode(self, ids: Any) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def check_tokenizer_spec(spec: str) -> None:
    """MsjaxError unless data.tokenizer is `byte` or names a file."""
    if spec != "byte" and not Path(spec).expanduser().is_file():
        raise MsjaxError(
            f"data.tokenizer={spec}: no such file; give byte, a SentencePiece .model file "
            "or a Hugging Face tokenizer.json file"
        )


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by data.tokenizer: `byte`, a SentencePiece .model or a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    check_tokenizer_spec(spec)
    path = Path(spec).expanduser()
    content = path.read_bytes()
    # By content, not by name: a tokenizer.json is a JSON object, a .model a binary protobuf.
    if _is_json_object(content):
        _require("tokenizers", spec)
        return HuggingFaceTokenizer(content, path)
    _require("sentencepiece", spec)
    return SentencePieceTokenizer(content, path)


def _is_json_object(content: bytes) -> bool:
    if content.lstrip()[:1] != b"{":
        return False
    try:
        return isinstance(json.loads(content), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def _require(package: str, spec: str) -> None:
    try:
        __import__(package)
    except ImportError:
        raise MsjaxError(
            f"data.tokenizer={spec} needs the {package} package; {INSTALL_HINT}"
        ) from None


def _neither_format(path: Path) -> str:
    return (
        f"data.tokenizer={path} is neither a SentencePiece .model nor a Hugging Face "
        "tokenizer.json file"
    )
