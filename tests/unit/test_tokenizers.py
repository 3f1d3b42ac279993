"""Specifications of the tokenizers (byte, SentencePiece, tokenizer.json) and of text sources
read through each of them."""

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import tokenizers
from test_data_sources import (
    DOCUMENTS,
    data_config,
    expected_streams,
    load,
    tokens_of,
    write_text_corpus,
)
from tokenizers import decoders, models, pre_tokenizers, trainers

from msjax.config import SourceConfig
from msjax.data.tokenizer import ByteTokenizer, load_tokenizer
from msjax.errors import MsjaxError


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> Path:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(DOCUMENTS * 5), model_writer=model, vocab_size=50, minloglevel=2
    )
    path = tmp_path_factory.mktemp("sentencepiece") / "tiny.model"
    path.write_bytes(model.getvalue())
    return path


def train_tokenizer_json(path: Path, special_tokens: list[str]) -> Path:
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(DOCUMENTS, trainer=trainer)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("huggingface") / "tokenizer.json"
    return train_tokenizer_json(path, ["<unk>", "<|endoftext|>"])


def test_byte_tokenizer_is_the_default_and_names_itself_byte():
    tokenizer = load_tokenizer("byte")
    assert isinstance(tokenizer, ByteTokenizer)
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id) == ("byte", 257, 256)
    assert tokenizer.encode("é").tolist() == [0xC3, 0xA9]


def test_sentencepiece_model_encodes_as_sentencepiece_does_and_ends_documents_with_its_eos(
    sentencepiece_model,
):
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    tokenizer = load_tokenizer(str(sentencepiece_model))
    digest = hashlib.sha256(sentencepiece_model.read_bytes()).hexdigest()
    assert tokenizer.name == f"sentencepiece:{digest}"
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (50, reference.eos_id())
    ids = tokenizer.encode(DOCUMENTS[3])
    assert ids.dtype == np.uint16 and ids.tolist() == reference.encode(DOCUMENTS[3])
    assert tokenizer.decode(ids) == reference.decode(reference.encode(DOCUMENTS[3]))


def test_tokenizer_json_takes_endoftext_as_eos_and_adds_no_special_tokens(tokenizer_json):
    reference = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tokenizer = load_tokenizer(str(tokenizer_json))
    digest = hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    assert tokenizer.name == f"huggingface:{digest}"
    assert tokenizer.eos_id == reference.token_to_id("<|endoftext|>") == 1
    assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    ids = tokenizer.encode("naïve café")
    assert ids.tolist() == reference.encode("naïve café", add_special_tokens=False).ids
    assert tokenizer.decode(ids) == " naïve café"  # ByteLevel adds a prefix space


def test_tokenizer_json_without_an_end_of_text_token_is_refused(tmp_path):
    path = train_tokenizer_json(tmp_path / "tokenizer.json", ["<unk>"])
    with pytest.raises(MsjaxError, match=r"tokenizer\.json has no end-of-text token.*</s>"):
        load_tokenizer(str(path))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        (b"\x00\x01not a model\xff" * 10, "neither a SentencePiece .model nor"),
        (b'{"vocab": []}', "neither a SentencePiece .model nor"),
    ],
)
def test_tokenizer_file_that_is_missing_or_of_neither_format_is_refused(
    tmp_path, content, expected
):
    path = tmp_path / "tokenizer.model"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(MsjaxError, match=expected) as error:
        load_tokenizer(str(path))
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def reference_encode(tokenizer_kind: str, sentencepiece_model: Path, tokenizer_json: Path):
    """Token ids by the tokenizer libraries themselves, not through msjax's wrappers."""
    if tokenizer_kind == "byte":
        return str.encode
    if tokenizer_kind == "sentencepiece":
        return sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model)).encode
    reference = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    return lambda text: reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("tokenizer_kind", ["byte", "sentencepiece", "huggingface"])
def test_text_files_stream_each_document_then_eos_with_crc32_held_out_documents_in_eval(
    tmp_path, tokenizer_kind, sentencepiece_model, tokenizer_json
):
    corpus = write_text_corpus(tmp_path / "corpus")
    spec = {"byte": "byte", "sentencepiece": sentencepiece_model, "huggingface": tokenizer_json}
    sources = [
        SourceConfig(path=str(tmp_path / "corpus" / pattern), text_field="body")
        if pattern == "c.jsonl.gz"
        else SourceConfig(path=str(tmp_path / "corpus" / pattern))
        for pattern in corpus
    ]
    data = data_config(tmp_path, *sources, tokenizer=str(spec[tokenizer_kind]))
    tokenizer = load_tokenizer(data.tokenizer)
    encode = reference_encode(tokenizer_kind, sentencepiece_model, tokenizer_json)

    streams, _ = load(data, tokenizer, vocab_size=512)

    assert [s.label for s in streams] == [str(tmp_path / "corpus" / p) for p in corpus]
    total_held_out = 0
    for stream, documents in zip(streams, corpus.values(), strict=True):
        train, held_out = expected_streams(documents, encode, tokenizer.eos_id)
        assert tokens_of(stream.train) == train
        assert tokens_of(stream.eval) == held_out
        total_held_out += stream.facts["eval_documents"]
        assert stream.facts["documents"] == len(documents)
        assert stream.facts["train_tokens"] == len(train)
        assert stream.facts["tokenizer"] == tokenizer.name and stream.facts["cache"] == "built"
    assert 0 < total_held_out < len(DOCUMENTS)  # the split is exercised both ways
