"""OpenAI request shapes (field for field, in OpenAI's order), plus vLLM's extensions. Responses are
built in server/completions.py and server/chat.py in OpenAI's shapes; the openai client parses
them in the tests."""
from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class VLLMExtensions(BaseModel):
    """vLLM's sampling extensions, accepted by both endpoints."""
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False


class CompletionRequest(VLLMExtensions):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    user: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None


class ChatCompletionRequest(VLLMExtensions):
    model_config = ConfigDict(extra="allow")
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    user: str | None = None
