"""server/fast_json.py's token-id path: a flat list of JSON integers becomes the engine's int32 array
without Python ints, and every other body is left to the ordinary parse (None), so its errors stay."""
import array
import json
import random

import pytest

from burstserve.server.fast_json import token_ids_body
from burstserve.server.protocol import CompletionRequest


def _ids(n):
    return [random.randrange(0, 1 << 31) if random.random() < 0.05 else random.randrange(200_000) for _ in range(n)]


@pytest.mark.parametrize("dump", [
    lambda d: json.dumps(d),
    lambda d: json.dumps(d, separators=(",", ":")),
    lambda d: json.dumps(d, indent=2),
    lambda d: json.dumps(d).replace(", ", " ,\r\n\t "),
])
def test_token_ids_arrive_as_the_int32_array_of_the_same_request(dump):
    for _ in range(20):
        ids = _ids(random.randrange(1, 3000)) + [0, 9, 10, 99, 100, (1 << 31) - 1]
        random.shuffle(ids)
        body = {"model": "m", "max_tokens": random.randrange(1, 99), "prompt": ids,
                "stop": ["\"prompt\": [1]"], "stop_token_ids": [1, 2], "response_format": {"type": "json_object"}}
        if random.random() < 0.5:
            body = {"prompt": body.pop("prompt"), **body}    # first or last key
        got = token_ids_body(dump(body).encode(), "prompt")
        assert type(got["prompt"]) is array.array and got["prompt"].typecode == "i"
        assert got["prompt"].tolist() == ids
        assert {k: v for k, v in got.items() if k != "prompt"} == {k: v for k, v in body.items() if k != "prompt"}
        assert CompletionRequest.model_validate(got).prompt.tolist() == ids


@pytest.mark.parametrize("text", [
    '{"prompt": [1, -2, 3]}', '{"prompt": [1, 2.0]}', '{"prompt": [1, 2e3]}', '{"prompt": [1, 02]}',
    '{"prompt": [00]}', '{"prompt": [1, 2,]}', '{"prompt": [1,, 2]}', '{"prompt": [1 2]}', '{"prompt": [ ]}',
    '{"prompt": []}', '{"prompt": [1, ]}', '{"prompt": [, 1]}', '{"prompt": [[1, 2], [3]]}',
    '{"prompt": [1, "2"]}', '{"prompt": [1, true]}', '{"prompt": [1, null]}', '{"prompt": [2147483648]}',
    '{"prompt": [99999999999999999999]}', '{"prompt": [9223372036854775807]}', '{"prompt": [1, +2]}',
    '{"prompt": "12"}', '{"prompt": [1, 2]', '{"prompt": [1, 2], "max_tokens": }', '[{"prompt": [1]}]',
    '{"x": {"prompt": [1, 2]}, "prompt": "text"}', '{"x": {"prompt": [1, 2]}}',
    '{"prompt": [1, 2], "prompt": [3]}', '{"prompt": [1,\x0b2]}', '{"prompt" [1]}',
    '{"prompt": [ ,1]}', '{"prompt": [1, 2 , ]}', '{"prompt": [1, ,2]}',
])
def test_anything_but_a_flat_list_of_json_ints_takes_the_ordinary_path(text):
    assert token_ids_body(text.encode(), "prompt") is None


def test_only_the_named_field_is_read():
    assert token_ids_body(b'{"prompt": [5, 6]}', "input") is None
    assert token_ids_body(b'{"input": [5, 6]}', "input")["input"].tolist() == [5, 6]
