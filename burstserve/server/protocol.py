"""OpenAI request shapes (field for field, in OpenAI's order), plus vLLM's extensions.

Everything that can be checked on the request alone is checked here, so the OpenAPI schema says
what the server accepts: roles, required content, value ranges, and the OpenAI fields this server
does not do (tools, a non-empty logit_bias, penalties, suffix), each refused with a 400 naming the
field. What needs the model (vocabulary, context length) is checked in server/prompts.py.
Responses are built in server/completions.py and server/chat.py in OpenAI's shapes."""
import array
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, TypeAdapter, ValidationError,
                      field_validator)

from burstserve.engine.core.sampling import MAX_LOGPROBS

MAX_N = 64           # choices per prompt
MAX_STOPS = 4        # stop strings a request, as OpenAI's API allows
SEED_RANGE = dict(ge=-(1 << 53), le=1 << 53)   # a torch seed even as seed + j; exact as a JSON number (a double) too
STRICT = ConfigDict(strict=True)
TOKEN_IDS = TypeAdapter(list[StrictInt])   # one pass in pydantic-core, no Python call per id (bools refused)


def _number_only(value):
    """JSON Schema's numbers: 6.0 is an integer, but neither `false` nor "6" is a number (pydantic's lax
    mode would take both), so `max_tokens: false` is a 400 as the schema says."""
    if isinstance(value, (bool, str)):
        raise ValueError("Input should be a number")
    return value


def Number(kind: type, **bounds):
    """`int` or `float` as JSON Schema means them, with bounds (given before the check on the type, so
    the schema shows them as minimum/maximum)."""
    return Annotated[kind, Field(**bounds), BeforeValidator(_number_only)]


Int, Float = Number(int), Number(float)


def _unsupported(name: str, only: str):
    """A validator refusing every value but the allowed ones, with a message naming the field."""
    def check(value):
        raise ValueError(f"{name}={value!r} is not supported by this server (only {only})")
    return check


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: StrictBool = False


class JSONSchemaFormat(BaseModel):
    model_config = STRICT
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class _Format(BaseModel):
    model_config = STRICT

    def for_engine(self) -> dict | None:
        """What SamplingParams.response_format takes (None: unconstrained)."""
        return None if self.type == "text" else self.model_dump(by_alias=True, exclude_none=True)


class TextFormat(_Format):
    type: Literal["text"]


class JSONObjectFormat(_Format):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


# OpenAI's response_format: plain text, any JSON object, or JSON matching a schema (xgrammar)
ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaResponseFormat], Field(discriminator="type")]


class SamplingFields(BaseModel):
    """Sampling fields both endpoints share, with vLLM's extensions (top_k, ignore_eos, ...). A field that is none
    of these is refused by name, as OpenAI's API refuses it: ignored, a `repetition_penalty` or `min_p` meant for
    another server would change the answer without a word."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    frequency_penalty: Float = Field(0.0, ge=0, le=0, description="only 0 is supported")
    logit_bias: dict[str, Float] | None = Field(None, json_schema_extra={"maxProperties": 0},
                                                description="only an empty bias is supported")
    n: Int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Float = Field(0.0, ge=0, le=0, description="only 0 is supported")
    response_format: ResponseFormat | None = None
    seed: Number(int, **SEED_RANGE) | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Float = Field(1.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    user: str | None = None
    # vLLM's extensions
    top_k: Int = Field(-1, ge=-1, description="-1 or 0: every token")
    ignore_eos: StrictBool = False
    stop_token_ids: list[Number(int, ge=0)] | None = None
    return_tokens_as_token_ids: StrictBool = False

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            _unsupported("logit_bias", "an empty one")(value)
        return value

    @field_validator("frequency_penalty", "presence_penalty", mode="before")
    @classmethod
    def _no_penalty(cls, value, info):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            _unsupported(info.field_name, "0")(value)
        return value


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: (str | Annotated[list[str], Field(min_length=1)] | Annotated[list[Number(int, ge=0)], Field(min_length=1)]
             | Annotated[list[Annotated[list[Number(int, ge=0)], Field(min_length=1)]], Field(min_length=1)])
    best_of: Number(int, ge=1, le=MAX_N) | None = Field(None, description="only equal to n")
    echo: StrictBool = False
    logprobs: Number(int, ge=0, le=MAX_LOGPROBS) | None = None
    max_tokens: Number(int, ge=0) | None = Field(16, description="0 with echo scores the prompt only")
    suffix: str | None = Field(None, max_length=0, description="not supported")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_at_once(cls, value, handler):
        """A prompt of token ids, its types checked in one pass in pydantic-core (TOKEN_IDS; the union's
        per-element validators cost tens of times more on a long prompt), its range with the vocabulary in
        server/prompts.py. An int32 array.array is what server/fast_json.py made of a flat list of JSON
        integers (no JSON value parses to one): already typed. Anything else (text, several prompts, a
        bad type) takes the full validation and its error messages."""
        if type(value) is array.array:
            return value
        if type(value) is list and value and type(value[0]) is int:
            try:
                return TOKEN_IDS.validate_python(value)
            except ValidationError:
                pass
        return handler(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            _unsupported("suffix", "none")(value)
        return value


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


def _text_parts_only(content):
    """Content is a string or a list of text parts; other parts (images, audio) get a clear 400."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
    return content


Content = str | list[TextPart]


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    content: Content
    name: str | None = None
    _content_parts = field_validator("content", mode="before")(_text_parts_only)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    role: Literal["developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    tool_calls: list[dict] | None = Field(None, json_schema_extra={"maxItems": 0}, description="not supported")

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value):
        if value:
            raise ValueError("tool calls are not supported by this server (no tool calling)")
        return value


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str


ChatMessage = Annotated[Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
                        Field(discriminator="role")]


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, json_schema_extra={
        "dependentSchemas": {"top_logprobs": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}})
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str | None = None
    logprobs: StrictBool | None = False
    max_completion_tokens: Number(int, ge=1) | None = None
    max_tokens: Number(int, ge=1) | None = Field(None, description="the older name of max_completion_tokens")
    tools: list[dict] | None = Field(None, json_schema_extra={"maxItems": 0}, description="not supported")
    tool_choice: Literal["none", "auto"] | None = Field(None, description="no tool calling: none or auto")
    parallel_tool_calls: StrictBool | None = None
    top_logprobs: Number(int, ge=0, le=MAX_LOGPROBS) | None = None
    functions: list[dict] | None = Field(None, json_schema_extra={"maxItems": 0}, description="not supported")
    function_call: Literal["none", "auto"] | None = Field(None, description="no function calling: none or auto")
    # OpenAI's fields about the service, not the answer: taken, and nothing to do here
    metadata: dict[str, str] | None = Field(None, description="taken and not used")
    store: StrictBool | None = Field(None, description="taken and not used: nothing is stored")
    service_tier: str | None = Field(None, description="taken and not used")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true (as OpenAI)")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} are not supported by this server (no tool calling)")
        return value

    @field_validator("tool_choice", "function_call", mode="before")
    @classmethod
    def _no_tool_choice(cls, value, info):
        if value not in (None, "none", "auto"):
            _unsupported(info.field_name, "'none' or 'auto': no tool calling")(value)
        return value

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the limit, the name the client gave it): max_completion_tokens is the newer name."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"
