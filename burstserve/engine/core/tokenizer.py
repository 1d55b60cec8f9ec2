"""Tokenizers: transformers' from the model directory when present, a byte-level one for presets."""
import logging
import os

from burstserve.engine.core.errors import InvalidRequestError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, BOS 256, EOS 257; other ids (random-weight presets) decode to nothing."""
    bos_token_id, eos_token_id = 256, 257
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for BOS, EOS and unused ids)."""
        return bytes([token_id]) if 0 <= token_id < 256 else b""


class HFTokenizer:
    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.bos_token_id, self.eos_token_id = self.tok.bos_token_id, self.tok.eos_token_id
        self.chat_template = getattr(self.tok, "chat_template", None)
        self._byte_level: bool | None = None   # found on first use of token_bytes

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token: byte-fallback pieces (<0xNN>), byte-level BPE pieces (GPT-2's
        byte-to-character table), else the piece's text with SentencePiece's space mark as a space."""
        piece = self.tok.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self._byte_level is None:
            self._byte_level = "\u0120" in self.tok.get_vocab()    # "Ġ": byte-level BPE marks a space so
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return piece.replace("\u2581", " ").encode("utf-8")


class NoTokenizer:
    """A model directory without tokenizer files: token-id prompts only."""
    bos_token_id = eos_token_id = chat_template = None

    def __init__(self, model_dir: str):
        self.model_dir = model_dir

    def encode(self, text: str) -> list[int]:
        raise InvalidRequestError(f"model {self.model_dir!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                                  "send the prompt as a list of token ids", "prompt")

    def decode(self, ids: list[int]) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the rest map to U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_table()


def load_tokenizer(model: str, is_preset: bool):
    if is_preset:
        return ByteTokenizer()
    if any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return HFTokenizer(model)
    log.warning("model directory %r has no tokenizer files (%s): text prompts and chat requests will be refused; "
                "only prompts of token ids can be served. Copy the tokenizer's files from the checkpoint it was "
                "saved with.", model, ", ".join(TOKENIZER_FILES))
    return NoTokenizer(model)
