"""Generated tokens to text: incremental detokenization and stop strings."""
REPLACEMENT = "\ufffd"


class TextAssembler:
    """Feeds token ids, returns the new text that is safe to send.

    The text grows only at its end (vLLM's prefix/read offsets): each token decodes a short window
    of recent ids, and the window's text past what the settled ids already gave is appended once
    it no longer ends in an incomplete UTF-8 character (U+FFFD). Text already settled never
    changes, so a stop string is cut exactly where the uncut text has it. Text that could still be
    the start of a stop string is held back until the next token settles it; a stop string ends
    the text just before it. Decoding costs O(window) per token, not O(generated)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0        # ids[prefix_offset:read_offset]: context already turned into text
        self.read_offset = 0          # ids from here on are not text yet
        self.text = ""                # the settled text
        self.sent = 0                 # characters of it already returned
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        self._settle(final=False)
        return self._release(self.hold)

    def finish(self) -> str:
        """The held-back rest (an incomplete character at the very end as U+FFFD), once the
        generation ended; "" after a stop string."""
        if self.stopped:
            return ""
        self._settle(final=True)
        return self._release(0)

    def _release(self, hold: int) -> str:
        """The settled text up to a stop string (then stopped), else all but the last `hold` characters."""
        hits = [at for stop in self.stops if (at := self.text.find(stop, max(0, self.sent - len(stop)))) != -1]
        if hits:   # the earliest stop string wins
            self.stopped = True
            return self._take(min(hits))
        return self._take(len(self.text) - hold)

    def _settle(self, final: bool) -> None:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and (final or not window.endswith(REPLACEMENT)):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

