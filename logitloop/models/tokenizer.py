"""A thin wrapper over `tokenizers.Tokenizer` loaded from a checkpoint's `tokenizer.json`.

It adds what the decode loop needs and `tokenizers` does not give directly: the raw bytes
each token contributes to the text (`token_bytes`), which stop-string tables are built
from, and the BOS/EOS ids.

Conventions:
- `encode(text)` adds special tokens the way `transformers`' `AutoTokenizer` does by
  default: whatever the tokenizer's own post-processor adds (a BOS for Llama, nothing for
  GPT-2).
- `decode(ids)` drops special tokens by default, and `token_bytes` of a special token is
  `b""`, so for byte-level BPE `b"".join(map(token_bytes, ids)).decode() == decode(ids)`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"  # "▁", sentencepiece's stand-in for a space


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _component_types(spec: Any) -> set[str]:
    """Every `type` named in a tokenizer.json component, descending into sequences."""
    found: set[str] = set()
    if isinstance(spec, dict):
        if "type" in spec:
            found.add(spec["type"])
        for value in spec.values():
            found |= _component_types(value)
    elif isinstance(spec, list):
        for item in spec:
            found |= _component_types(item)
    return found


class Tokenizer:
    """Text <-> token ids, plus per-token bytes and the special ids.

    Attributes:
      vocab_size: number of ids the tokenizer knows, added tokens included. A model's
        vocabulary may be larger (padded); ids beyond this decode to nothing.
      bos_token_id: the beginning-of-sequence id, or None.
      eos_token_ids: every end-of-sequence id, possibly empty.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
    ):
        self._tok = tokenizer
        # Padding/truncation saved in tokenizer.json would change encode(); HF's fast
        # tokenizers switch them off unless asked, and so does this wrapper.
        self._tok.no_padding()
        self._tok.no_truncation()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self._token_bytes: list[bytes] | None = None

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> Tokenizer:
        """Load `tokenizer.json`.

        BOS/EOS ids not given here are read from a `tokenizer_config.json` beside it
        (`bos_token` / `eos_token`), when there is one.
        """
        path = Path(path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception for bad files
            raise ValueError(f"{path}: cannot load tokenizer: {e}") from e
        special = _special_tokens_from_config(path.parent / "tokenizer_config.json")
        if bos_token_id is None and special.get("bos_token") is not None:
            bos_token_id = tok.token_to_id(special["bos_token"])
        if eos_token_ids is None:
            eos = special.get("eos_token")
            eos_id = tok.token_to_id(eos) if eos is not None else None
            eos_token_ids = () if eos_id is None else (eos_id,)
        return cls(tok, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)

    def to_str(self) -> str:
        """The tokenizer.json text (for saving next to converted weights)."""
        return self._tok.to_str()

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id, or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def added_tokens(self) -> dict[int, str]:
        """Id -> text of every token added on top of the base vocabulary (special or not)."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the post-processor's special tokens (e.g. BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special_tokens=False`."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes token `token_id` contributes to decoded text.

        Byte-level BPE tokens map back through GPT-2's byte table; sentencepiece-style
        tokens turn "▁" into a space and `<0xNN>` into the byte NN. A token may hold part
        of a multi-byte character, so only concatenations are guaranteed valid UTF-8.
        Special tokens, and ids the tokenizer does not know, give `b""`. For
        sentencepiece vocabularies a word-initial "▁" counts as a space even at the very
        start, where `decode` strips it.
        """
        token_id = int(token_id)
        if token_id < 0:
            raise ValueError(f"token_id must be >= 0, got {token_id}")
        table = self.all_token_bytes()
        return table[token_id] if token_id < len(table) else b""

    def all_token_bytes(self) -> list[bytes]:
        """`token_bytes` of every id in `range(vocab_size)`, computed once."""
        if self._token_bytes is None:
            self._token_bytes = self._build_token_bytes()
        return self._token_bytes

    def _build_token_bytes(self) -> list[bytes]:
        spec = json.loads(self._tok.to_str())
        decoder_types = _component_types(spec.get("decoder"))
        byte_level = "ByteLevel" in decoder_types
        added = self._tok.get_added_tokens_decoder()  # id -> AddedToken
        table = []
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            if token is None:
                table.append(b"")
            elif i in added:
                # Added tokens are decoded as their literal content, never byte-mapped.
                table.append(b"" if added[i].special else added[i].content.encode("utf-8"))
            elif byte_level:
                table.append(
                    b"".join(
                        bytes([_UNICODE_TO_BYTE[ch]])
                        if ch in _UNICODE_TO_BYTE
                        else ch.encode("utf-8")
                        for ch in token
                    )
                )
            elif (m := _BYTE_TOKEN.match(token)) is not None:
                table.append(bytes([int(m.group(1), 16)]))
            else:
                table.append(token.replace(_SPIECE_SPACE, " ").encode("utf-8"))
        return table


def _special_tokens_from_config(path: Path) -> dict[str, str | None]:
    """`bos_token` / `eos_token` strings from a tokenizer_config.json, if it exists."""
    if not path.is_file():
        return {}
    try:  # not UTF-8 or not JSON: ValueError
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read tokenizer config: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    out: dict[str, str | None] = {}
    for key in ("bos_token", "eos_token"):
        value = data.get(key)
        # Either a plain string or a serialised AddedToken dict with "content".
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out
