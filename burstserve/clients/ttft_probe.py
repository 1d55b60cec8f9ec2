"""Time to first token (and per output token) of a running server, measured on the client over the SSE stream.

    python -m burstserve.clients.ttft_probe --url http://127.0.0.1:8000 --prompt-tokens 32768 --repeats 3
    python -m burstserve.clients.ttft_probe --url http://127.0.0.1:8000 --prompt-tokens 8192 --output-len 128
Sends token-id prompts of exactly that length (random ids, fresh each time) with stream=true and
ignore_eos, so each request generates exactly --output-len tokens (default 1). TTFT is the time from
sending the encoded body on an open connection until the first SSE chunk that carries a token; TPOT is (time of the last token chunk - time of the first) /
(tokens - 1). The server sends one chunk per token; the count is checked against the stream's usage.
"""
import argparse
import asyncio
import json
import random

import httpx

from burstserve.clients.sse import read_stream
from burstserve.clients.stats import RequestTiming


def completion_body(model: str | None, prompt_tokens: int, vocab: int, output_len: int) -> dict:
    """A streamed completion of `prompt_tokens` random ids that generates exactly `output_len` tokens."""
    body = {"prompt": [random.randrange(vocab) for _ in range(prompt_tokens)], "max_tokens": output_len,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    return body


async def stream_once(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestTiming:
    """Sends one streamed request and reads it to its end -> when it was sent and when each token chunk came."""
    record = await read_stream(client, url, body, headers)
    if record.error:
        raise RuntimeError(record.error)
    check_token_count(len(record.token_times), body["max_tokens"], record.usage)
    return RequestTiming(record.sent, record.token_times)


def check_token_count(chunks: int, asked: int, usage: dict | None) -> None:
    """Raises RuntimeError unless the stream carried exactly `asked` tokens, one per chunk."""
    if chunks == 0:
        raise RuntimeError("the stream ended without a token")
    if usage is not None and usage.get("completion_tokens") != chunks:
        raise RuntimeError(f"{chunks} token chunks but usage says {usage.get('completion_tokens')} tokens")
    if chunks != asked:
        raise RuntimeError(f"asked for {asked} tokens (ignore_eos), the stream carried {chunks}")


def stream_batch(url: str, model: str | None, prompt_tokens: int, vocab: int, api_key: str | None,
                 output_len: int = 1, batch: int = 1) -> list[RequestTiming]:
    """`batch` streamed requests sent together (one connection each), each a fresh prompt of `prompt_tokens`
    random ids generating `output_len` tokens -> their timings, perf_counter seconds. The first error raises."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bodies = [completion_body(model, prompt_tokens, vocab, output_len) for _ in range(batch)]

    async def run() -> list[RequestTiming]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
            # one open keep-alive connection per request first, as a client with a pooled session has
            # (OpenAI's SDK, vLLM's bench): TTFT does not count a TCP connect
            await asyncio.gather(*(client.get(f"{url}/health") for _ in bodies))
            return list(await asyncio.gather(*(stream_once(client, url, b, headers) for b in bodies)))
    return asyncio.run(run())


def ttft_once(url: str, model: str | None, prompt_tokens: int, vocab: int, api_key: str | None,
              max_tokens: int = 1) -> float:
    """Seconds from sending the request to the first SSE chunk carrying a token (reads the stream to its end)."""
    return stream_batch(url, model, prompt_tokens, vocab, api_key, max_tokens)[0].ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", default="32768", help="one length or a comma list, measured in order")
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=1, help="tokens each request generates (ignore_eos)")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    for n in [int(x) for x in args.prompt_tokens.split(",")]:
        timings = [stream_batch(args.url, args.model, n, args.vocab, args.api_key, args.output_len)[0]
                   for _ in range(args.repeats)]
        times = [t.ttft for t in timings]
        line = {"prompt_tokens": n, "ttft_seconds": times, "best": min(times)}
        if args.output_len > 1:
            line.update(output_len=args.output_len, tpot_seconds=[t.tpot for t in timings])
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
