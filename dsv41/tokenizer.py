"""Tokenizers for generation: UTF-8 bytes when none is given, or a `tokenizer.json` (the `tokenizers` package).

Both give `encode(text) -> ids`, `decode(ids) -> text`, `stream()` (a decoder fed one id at a time
that never splits a character: it holds the bytes of an unfinished one until they complete it) and
`token_id(text)` (the one id a stop string stands for). `load_tokenizer` checks the tokenizer's ids
against the model's vocabulary.
"""

from __future__ import annotations

import codecs

from dsv41.errors import ConfigError


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; invalid UTF-8 decodes to U+FFFD (errors="replace")."""

    vocab_size = 256
    name = "the byte-level tokenizer"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = list(ids)
        check_ids(ids, self)
        return bytes(ids).decode("utf-8", errors="replace")

    def stream(self) -> ByteStream:
        return ByteStream(self)

    def token_id(self, text: str) -> int:
        return _single(self, text, self.encode(text))


class ByteStream:
    """Streaming byte-level decode: `step(id)` returns the characters it completes, `flush()` the rest."""

    def __init__(self, tokenizer: ByteTokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        check_ids([token_id], self._tokenizer)
        return self._utf8.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class JsonTokenizer:
    """A `tokenizer.json` loaded with `tokenizers.Tokenizer.from_file`; special tokens are kept in decoded text."""

    def __init__(self, path):
        import tokenizers

        self.name = f"the tokenizer {path}"
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for a missing or malformed file
            raise ValueError(f"tokenizer: {str(path)!r}: expected a tokenizer.json file ({e})") from e
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        ids = list(ids)
        check_ids(ids, self)
        return self._tok.decode(ids, skip_special_tokens=False)

    def stream(self) -> JsonStream:
        return JsonStream(self)

    def token_id(self, text: str) -> int:
        token = self._tok.token_to_id(text)
        if token is not None:
            return token
        return _single(self, text, self._tok.encode(text, add_special_tokens=False).ids)


class JsonStream:
    """Streaming decode through `tokenizers.decoders.DecodeStream`, which holds back unfinished characters."""

    def __init__(self, tokenizer: JsonTokenizer):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._pending: list[int] = []

    def step(self, token_id: int) -> str:
        check_ids([token_id], self._tokenizer)
        self._pending.append(token_id)
        text = self._stream.step(self._tokenizer._tok, token_id)
        if text is None:
            return ""
        self._pending = []
        return text

    def flush(self) -> str:
        """The ids DecodeStream still holds (an unfinished character), decoded with replacement."""
        text, self._pending = self._tokenizer.decode(self._pending) if self._pending else "", []
        return text


def load_tokenizer(cfg, path=None) -> ByteTokenizer | JsonTokenizer:
    """The tokenizer at `path` (a tokenizer.json), or the byte-level one; its ids must fit the model's vocabulary."""
    tokenizer = ByteTokenizer() if path is None else JsonTokenizer(path)
    vocab = cfg.architecture.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError("architecture.vocab_size", vocab,
                          f"expected at least {tokenizer.vocab_size}: {tokenizer.name} has ids "
                          f"0..{tokenizer.vocab_size - 1}")
    return tokenizer


def check_ids(ids, tokenizer) -> None:
    """Raises ValueError naming the ids outside the tokenizer's vocabulary."""
    bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if bad:
        raise ValueError(f"token ids {list(dict.fromkeys(bad))[:8]}: expected ids in 0..{tokenizer.vocab_size - 1} "
                         f"({tokenizer.name})")


def _single(tokenizer, text: str, ids: list[int]) -> int:
    if len(ids) != 1:
        raise ValueError(f"stop: {text!r}: encodes to {len(ids)} tokens {ids[:8]} with {tokenizer.name}; "
                         "expected one token (a stop string must be a single token, or give its id)")
    return ids[0]
