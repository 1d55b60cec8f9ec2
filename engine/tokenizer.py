"""Tokenizers: transformers' from the model directory when present, a byte-level one for presets."""
import os

from engine.errors import InvalidRequestError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, BOS 256, EOS 257; other ids (random-weight presets) decode to nothing."""
    bos_token_id, eos_token_id = 256, 257
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.bos_token_id, self.eos_token_id = self.tok.bos_token_id, self.tok.eos_token_id
        self.chat_template = getattr(self.tok, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


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


def load_tokenizer(model: str, is_preset: bool):
    if is_preset:
        return ByteTokenizer()
    if any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return HFTokenizer(model)
    return NoTokenizer(model)
