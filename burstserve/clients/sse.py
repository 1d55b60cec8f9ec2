"""Reading one streamed completion (server-sent events), as every bench client does: when it was sent
(its body already encoded: json.dumps of a 128K-token prompt takes the client 12 ms, the client's own
preparation like drawing the prompt, not the server's latency), when each token's chunk arrived
(perf_counter seconds, taken as its line arrives, before parsing), the usage the server reported, and
what went wrong (an HTTP status, an error event, a transport failure) as a string instead of an exception."""
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamRecord:
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)   # one per chunk with a choice: one token each
    ended: float = 0.0                # when the server ended the stream (0: it did not)
    usage: dict | None = None
    finished: bool = False            # ended by the server, without an error (not cancelled by us)
    error: str = ""


async def read_stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                      into: StreamRecord | None = None, on_token=None) -> StreamRecord:
    """POSTs `body` to /v1/completions (stream: true) and reads the stream to its end. `into`: a record to
    fill as it goes (what a cancelled task leaves is kept); on_token(): called at each token's chunk."""
    record = into if into is not None else StreamRecord()
    content = json.dumps(body, separators=(",", ":")).encode()
    headers = {**headers, "Content-Type": "application/json"}
    record.sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", content=content, headers=headers, timeout=3600) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}"
                return record
            async for line in r.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return record
                if chunk.get("choices"):
                    record.token_times.append(now)
                    if on_token is not None:
                        on_token()
                record.usage = chunk.get("usage") or record.usage
        record.ended, record.finished = time.perf_counter(), True
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    return record
