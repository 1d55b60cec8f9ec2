"""Prompts as token ids, checked against the model: the vocabulary, the context length, the KV
capacity. Chat messages are rendered with the tokenizer's chat template, or a plain default.
A checked prompt is an int32 array (array.array, engine.outputs.PROMPT_TYPECODE): checked in C, and it
crosses to the engine's worker as bytes (engine/core/outputs.py Request)."""
import array
import asyncio
import logging

import torch

from burstserve.engine.core.errors import InvalidRequestError
from burstserve.engine.core.outputs import PROMPT_TYPECODE
from burstserve.server.context import ServerContext
from burstserve.server.errors import APIError
from burstserve.server.protocol import ChatCompletionRequest

log = logging.getLogger("burstserve")

# Used when the tokenizer has no chat template (documented in the README; a warning at start):
#   <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
DEFAULT_TEMPLATE_ROLE = "<|{role}|>\n{content}\n"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def warn_if_default_chat_template(tokenizer, model: str) -> None:
    if not has_chat_template(tokenizer):
        log.warning("model %s has no chat template: chat requests use the default one (%r per message, then "
                    "'<|assistant|>\\n')", model, DEFAULT_TEMPLATE_ROLE)


async def encode_text(ctx: ServerContext, text: str) -> list[int]:
    """Tokenizes off the event loop (a book-length prompt takes a while)."""
    return await asyncio.get_running_loop().run_in_executor(None, ctx.llm.tokenizer.encode, text)


async def completion_prompts(ctx: ServerContext, prompt) -> list[tuple[str | None, array.array]]:
    """(text or None, token ids) for each prompt of a completion request (protocol.py validated it: a
    string, or a list whose items are all of one kind)."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for item in items:
        ids = await encode_text(ctx, item) if isinstance(item, str) else item
        out.append((item if isinstance(item, str) else None, check_token_ids(ctx, ids)))
    return out


async def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> array.array:
    """The messages rendered and tokenized."""
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    tok = ctx.llm.tokenizer

    def render() -> list[int]:
        if has_chat_template(tok):
            ids = tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        text = "".join(DEFAULT_TEMPLATE_ROLE.format(**m) for m in messages) + "<|assistant|>\n"
        return tok.encode(text)
    return check_token_ids(ctx, await asyncio.get_running_loop().run_in_executor(None, render))


def check_token_ids(ctx: ServerContext, ids: list[int] | array.array) -> array.array:
    """The ids as the engine's int32 array, each checked to be in the vocabulary (packed once and checked
    by its min and max, no Python per id; an int32 array from server/fast_json.py is copied as it is)."""
    vocab = ctx.llm.model_config.vocab_size
    if not ids:
        raise APIError(400, "the prompt is empty", "prompt")
    try:
        packed = array.array(PROMPT_TYPECODE, ids)
    except OverflowError:                        # beyond int32: outside any vocabulary
        packed = None
    values = torch.frombuffer(packed, dtype=torch.int32) if packed is not None else None
    if values is None or int(values.min()) < 0 or int(values.max()) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    return packed


def resolve_max_tokens(ctx: ServerContext, prompt_tokens: int, requested: int | None, where: str,
                       field: str = "max_tokens") -> int:
    """The tokens to generate; a 400 in vLLM's words (OpenAI's code) when prompt + max_tokens exceed
    the context. `field` is the name the client used for the limit."""
    limit = ctx.llm.max_model_len
    if prompt_tokens > limit or (requested is not None and prompt_tokens + requested > limit):
        asked = prompt_tokens + (requested or 0)
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{asked} tokens ({prompt_tokens} in the {where}, {requested or 0} in the completion). "
                            f"Please reduce the length of the {where} or completion.", where,
                       code="context_length_exceeded")
    max_tokens = requested if requested is not None else limit - prompt_tokens
    if max_tokens < 1:
        raise APIError(400, f"the {where} fills the model's whole context of {limit} tokens", where,
                       code="context_length_exceeded")
    try:
        ctx.llm.check_fits(prompt_tokens, max_tokens)
    except InvalidRequestError as e:   # named as the client named the limit
        raise APIError(400, str(e), field) from None
    return max_tokens


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
