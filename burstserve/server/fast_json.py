"""Request bodies parsed by pydantic-core's JSON parser (Rust) instead of json.loads: a long prompt's
body (800 KB of ids at 128K tokens) in a little over half json.loads' time, on the request's path to its
first token (docs/benchmarks.md, HTTP overhead).
Whatever it refuses is parsed again by json.loads, so errors and edge cases (a lone surrogate)
are exactly FastAPI's own.

A prompt of token ids skips Python ints altogether (`token_ids_body`): the route's id field, when it
holds a flat list of JSON integers, is read by numpy's C parser straight into the int32 array the
engine takes, in about half the time of parsing, type-checking and packing them in turn. Any body that
is not exactly that takes the ordinary path above, so every error stays what it was."""
import array
import json
import re
import secrets
from typing import Any, Callable

import numpy as np
import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute

from burstserve.engine.core.outputs import PROMPT_TYPECODE

# route path -> the top-level field that may hold token ids (read by token_ids_body)
TOKEN_ID_FIELDS = {"/v1/completions": "prompt"}
INT32_END = 2 ** 31
ID_TEXT = b"0123456789, \t\n\r"           # all a flat list of non-negative JSON integers may contain
NOT_DIGITS = b", \t\n\r"
JSON_WHITESPACE = b" \t\n\r"
POWERS_OF_TEN = [10 ** k for k in range(1, 10)]
# stands in for the ids while the rest of the body is parsed: no client can send it by chance
PLACEHOLDER = f"\0burstserve-token-ids-{secrets.token_hex(8)}"
PLACEHOLDER_JSON = json.dumps(PLACEHOLDER).encode()
LIST_OPENS = re.compile(rb"[ \t\n\r]*:[ \t\n\r]*\[")


def decimal_digits(values: np.ndarray) -> int:
    """How many digits the values take written in decimal without leading zeros."""
    return len(values) + sum(int(np.count_nonzero(values >= p)) for p in POWERS_OF_TEN)


def parse_ids(text: bytes) -> np.ndarray | None:
    """`1, 2,3` -> int64 values, or None unless the text is exactly comma-separated JSON integers
    in [0, 2**31): no sign, fraction, exponent, leading zero or empty item. numpy's parser refuses
    "1 2" and ", 1" but reads an empty item as 0 and skips a trailing comma: the digits count them."""
    if not text or text.translate(None, ID_TEXT) or text.rstrip(JSON_WHITESPACE).endswith(b","):
        return None
    try:
        values = np.fromstring(text, dtype=np.int64, sep=",")
    except ValueError:
        return None
    # every digit accounted for: no leading zeros, no empty item read as 0, nothing clipped to int64
    if len(text.translate(None, NOT_DIGITS)) != decimal_digits(values) or values.max() >= INT32_END:
        return None
    return values


def token_ids_body(body: bytes, field: str) -> dict | None:
    """The JSON object in `body` with its top-level `field` (a flat list of token ids) already an int32
    array.array; None for any other body (then the ordinary parse and validation answer it)."""
    key = json.dumps(field).encode()
    at = body.find(key)
    opened = LIST_OPENS.match(body, at + len(key)) if at >= 0 else None
    if opened is None:
        return None
    start = opened.end()
    end = body.find(b"]", start)
    values = parse_ids(body[start:end]) if end >= 0 else None
    if values is None:
        return None
    try:
        data = pydantic_core.from_json(body[:start - 1] + PLACEHOLDER_JSON + body[end + 1:])
    except ValueError:
        return None
    if type(data) is not dict or data.get(field) != PLACEHOLDER:   # the list was not the top-level field
        return None
    data[field] = array.array(PROMPT_TYPECODE, values.astype(np.int32).tobytes())
    return data


class FastJSONRequest(Request):
    token_id_field: str | None = None     # set by FastJSONRoute for routes in TOKEN_ID_FIELDS

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            parsed = token_ids_body(body, self.token_id_field) if self.token_id_field else None
            if parsed is not None:
                self._json = parsed
                return parsed
            try:
                self._json = pydantic_core.from_json(body)
            except ValueError:
                self._json = json.loads(body)     # raises json.JSONDecodeError as FastAPI expects, or parses
        return self._json


class FastJSONRoute(APIRoute):
    """FastAPI's documented way to give a route its own Request class."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        field = TOKEN_ID_FIELDS.get(self.path)

        async def with_fast_json(request: Request) -> Response:
            fast = FastJSONRequest(request.scope, request.receive)
            fast.token_id_field = field
            return await handler(fast)
        return with_fast_json
