"""Generated tokens to text: incremental detokenization, stop strings, and logprob entries."""
REPLACEMENT = "\ufffd"


class TextAssembler:
    """Feeds token ids, returns the new text that is safe to send.

    Text that could still be the start of a stop string, or an incomplete UTF-8 character, is held
    back until the next token settles it; a stop string ends the text just before it."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0                 # characters of the decoded text already returned
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop)))
            if at != -1:
                self.stopped = True
                return self._take(text, at)
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == REPLACEMENT:   # maybe a character cut in half
            safe -= 1
        return self._take(text, safe)

    def finish(self) -> str:
        """The held-back rest, once the generation ended without a stop string."""
        return "" if self.stopped else self._take(self.tokenizer.decode(self.ids), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else max(end, self.sent)
        piece = text[self.sent:end]
        self.sent = end
        return piece


def token_text(tokenizer, token_id: int, as_ids: bool) -> str:
    """How a token is named in logprobs: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def completion_logprob_entry(tokenizer, token_id: int, logprobs: dict[int, float], top: int, as_ids: bool):
    """(token, its logprob, {token: logprob} of the top `top`) for the legacy completions format."""
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:top]
    top_map = {token_text(tokenizer, t, as_ids): lp for t, lp in ranked}
    return token_text(tokenizer, token_id, as_ids), logprobs[token_id], top_map


def chat_logprob_entry(tokenizer, token_id: int, logprobs: dict[int, float], top: int, as_ids: bool) -> dict:
    def one(t, lp):
        name = token_text(tokenizer, t, as_ids)
        return {"token": name, "logprob": lp, "bytes": list(name.encode("utf-8"))}
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {**one(token_id, logprobs[token_id]), "top_logprobs": [one(t, lp) for t, lp in ranked]}
