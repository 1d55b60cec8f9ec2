"""Time to first token of a running server, measured on the client over the SSE stream.

    python -m clients.ttft_probe --url http://127.0.0.1:8000 --prompt-tokens 32768 --repeats 3
Sends token-id prompts of exactly that length (random ids, fresh each time) with max_tokens=1 and
stream=true; TTFT is the time until the first SSE chunk that carries a token.
"""
import argparse
import json
import random
import time

import httpx


def ttft_once(url: str, model: str | None, prompt_tokens: int, vocab: int, api_key: str | None,
              max_tokens: int = 1) -> float:
    """Seconds from sending the request to the first SSE chunk carrying a token (reads the stream to its end)."""
    body = {"prompt": [random.randrange(vocab) for _ in range(prompt_tokens)], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ttft = None
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", default="32768", help="one length or a comma list, measured in order")
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    for n in [int(x) for x in args.prompt_tokens.split(",")]:
        times = [ttft_once(args.url, args.model, n, args.vocab, args.api_key) for _ in range(args.repeats)]
        print(json.dumps({"prompt_tokens": n, "ttft_seconds": times, "best": min(times)}), flush=True)


if __name__ == "__main__":
    main()
