"""The `Tokenizer` wrapper: round trips, per-token bytes, special ids."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors

from logitloop.models import Tokenizer

from .tiny_checkpoints import byte_level_bpe

TEXTS = [
    "The quick brown fox",
    "naïve café — déjà vu 日本語 🙂!",
    "  leading spaces\nand\ttabs  ",
    "unseen: ж ü ∑ 𝔘 \u200b",
]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    byte_level_bpe().save(str(path))
    return Tokenizer.from_file(path, eos_token_ids=[0])


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A Llama-2-style vocabulary: "▁" for spaces, <0xNN> byte fallback, Strip decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab", "é", "▁é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "é")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return Tokenizer(tok, bos_token_id=1, eos_token_ids=[2])


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(byte_level, text):
    assert byte_level.decode(byte_level.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_token_bytes_concatenate_to_the_utf8(byte_level, text):
    ids = byte_level.encode(text)
    assert b"".join(byte_level.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_byte_level_single_tokens_may_split_a_character(byte_level):
    # "🙂" is 4 bytes and not a learned merge of its own: some token holds a partial char.
    ids = byte_level.encode("\U0001f642")
    pieces = [byte_level.token_bytes(i) for i in ids]
    assert b"".join(pieces) == "\U0001f642".encode()
    assert len(pieces) > 1


def test_special_tokens_contribute_no_bytes(byte_level):
    eos = byte_level.eos_token_id
    assert eos == 0
    ids = byte_level.encode("fox") + [eos]
    assert byte_level.token_bytes(eos) == b""
    assert byte_level.decode(ids) == "fox"
    assert "<|endoftext|>" in byte_level.decode(ids, skip_special_tokens=False)


def test_token_bytes_table_covers_the_vocabulary(byte_level):
    table = byte_level.all_token_bytes()
    assert len(table) == byte_level.vocab_size
    assert byte_level.token_bytes(byte_level.vocab_size + 10) == b""
    with pytest.raises(ValueError, match="token_id"):
        byte_level.token_bytes(-1)


def test_sentencepiece_pieces_and_byte_fallback(sentencepiece_style):
    tok = sentencepiece_style
    text = "ab a é ü"  # "ü" is not in the vocabulary: it falls back to <0xC3><0xBC>
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # the post-processor adds BOS, as HF does
    assert tok.decode(ids) == text
    body = b"".join(tok.token_bytes(i) for i in ids[1:])
    # The normalizer prepends "▁", which decode strips; token_bytes keeps it as a space.
    assert body == b" " + text.encode("utf-8")
    assert tok.token_bytes(3 + 0xC3) == b"\xc3"
    assert tok.token_bytes(tok.bos_token_id) == b""


def test_encode_follows_transformers_defaults(sentencepiece_style, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tokenizer.json"
    path.write_text(sentencepiece_style.to_str())
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    ours = Tokenizer.from_file(path)
    for text in ["ab a", "b é ü ab"]:
        assert ours.encode(text) == reference.encode(text)
        assert ours.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False
        )


def test_ids_from_tokenizer_config(sentencepiece_style, tmp_path):
    (tmp_path / "tokenizer.json").write_text(sentencepiece_style.to_str())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
    )
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.eos_token_id == 2


def test_bad_tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_file(path)
