"""Logprob entries in OpenAI's two formats, with token names that never collide.

A token is named by its text; a token that is not whole UTF-8 alone (its text would be U+FFFD)
is named by its bytes as OpenAI writes them (`bytes:\\xe2\\x80`), so two such tokens stay apart.
Within one position, a name that is still taken (two ids with the same text) falls back to
`token_id:N`. The sampled token is always among the top entries, as OpenAI's completions API says
(its entry added when it is not among the `top` most likely), and its name there is the name in
`tokens`."""
from dataclasses import dataclass

REPLACEMENT = "\ufffd"


@dataclass
class NamedToken:
    token_id: int
    name: str        # the key in top_logprobs, unique within a position
    raw: bytes       # the token's bytes (chat's `bytes` field)
    logprob: float


def token_name(tokenizer, token_id: int, as_ids: bool) -> tuple[str, bytes]:
    """(name, raw bytes) of one token: `token_id:N` (vLLM's return_tokens_as_token_ids), its text,
    or `bytes:\\xNN...` when its text alone is not whole UTF-8."""
    text = tokenizer.decode([token_id])
    raw = tokenizer.token_bytes(token_id) if REPLACEMENT in text else text.encode("utf-8")
    if as_ids:
        return f"token_id:{token_id}", raw
    if REPLACEMENT in text:
        return ("bytes:" + "".join(f"\\x{b:02x}" for b in raw)) if raw else f"token_id:{token_id}", raw
    return text, raw


def ranked_entries(tokenizer, token_id: int, logprobs: dict[int, float], top: int,
                   as_ids: bool) -> tuple[NamedToken, list[NamedToken]]:
    """(the sampled token, the top `top` tokens plus the sampled one if it is not among them)."""
    ranked = [t for t, _ in sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:top]]
    if token_id not in ranked:
        ranked.append(token_id)
    taken: set[str] = set()
    named: dict[int, NamedToken] = {}
    for t in [token_id] + [t for t in ranked if t != token_id]:    # the sampled token keeps its own name
        name, raw = token_name(tokenizer, t, as_ids)
        if name in taken:
            name = f"token_id:{t}"
        taken.add(name)
        named[t] = NamedToken(t, name, raw, logprobs[t])
    return named[token_id], [named[t] for t in ranked]


def completion_logprob_entry(tokenizer, token_id: int, logprobs: dict[int, float], top: int, as_ids: bool):
    """(token name, its logprob, {name: logprob} of the top `top` and the sampled token): the legacy format."""
    chosen, entries = ranked_entries(tokenizer, token_id, logprobs, top, as_ids)
    return chosen.name, chosen.logprob, {e.name: e.logprob for e in entries}


def chat_logprob_entry(tokenizer, token_id: int, logprobs: dict[int, float], top: int, as_ids: bool) -> dict:
    """One `logprobs.content` item of a chat completion."""
    chosen, entries = ranked_entries(tokenizer, token_id, logprobs, top, as_ids)

    def one(e: NamedToken) -> dict:
        return {"token": e.name, "logprob": e.logprob, "bytes": list(e.raw)}
    return {**one(chosen), "top_logprobs": [one(e) for e in entries] if top else []}
