"""Logprob names: unique per position, the sampled token always present, bytes for partial UTF-8."""
import random

from burstserve.engine.core.tokenizer import ByteTokenizer
from burstserve.server.logprobs import chat_logprob_entry, completion_logprob_entry, token_name


class SameTextTokenizer(ByteTokenizer):
    """Two ids that decode to the same whole text (as special tokens skipped to "" do)."""

    def decode(self, ids):
        return "x" if ids in ([300], [301]) else super().decode(ids)


def _random_logprobs(ids: list[int]) -> dict[int, float]:
    values = sorted((-random.uniform(0.01, 9) for _ in ids), reverse=True)
    return dict(zip(ids, values))


def test_partial_utf8_tokens_are_named_by_their_bytes():
    tok = ByteTokenizer()
    assert tok.decode([242]) == tok.decode([255]) == "\ufffd"
    assert token_name(tok, 242, False) == ("bytes:\\xf2", b"\xf2")
    assert token_name(tok, 255, False) == ("bytes:\\xff", b"\xff")
    assert token_name(tok, ord("a"), False) == ("a", b"a")
    assert token_name(tok, 242, True)[0] == "token_id:242"


def test_top_entries_never_collapse_and_hold_the_sampled_token():
    tok = ByteTokenizer()
    for _ in range(50):
        ids = random.sample(range(128, 256), 8)        # all partial UTF-8: every text is U+FFFD
        logprobs = _random_logprobs(ids)
        sampled = random.choice(ids)
        top = random.randint(0, 5)
        name, lp, top_map = completion_logprob_entry(tok, sampled, logprobs, top, False)
        ranked = sorted(logprobs, key=logprobs.get, reverse=True)[:top]
        assert len(top_map) == top + (sampled not in ranked)
        assert top_map[name] == lp == logprobs[sampled]
        assert all(top_map[token_name(tok, t, False)[0]] == logprobs[t] for t in ranked)


def test_same_text_falls_back_to_token_ids_and_the_sampled_token_keeps_its_name():
    tok = SameTextTokenizer()
    logprobs = {300: -0.5, 301: -1.0, 97: -2.0}
    name, lp, top_map = completion_logprob_entry(tok, 301, logprobs, 3, False)
    assert name == "x" and lp == -1.0
    assert top_map == {"x": -1.0, "token_id:300": -0.5, "a": -2.0}


def test_chat_entry_has_real_bytes_and_the_sampled_token():
    tok = ByteTokenizer()
    logprobs = {0xe2: -0.1, 0x80: -0.2, ord("b"): -0.3, 0xff: -4.0}
    entry = chat_logprob_entry(tok, 0xff, logprobs, 2, False)
    assert entry["token"] == "bytes:\\xff" and entry["bytes"] == [0xff] and entry["logprob"] == -4.0
    assert [e["bytes"] for e in entry["top_logprobs"]] == [[0xe2], [0x80], [0xff]]
    assert chat_logprob_entry(tok, 0xff, logprobs, 0, False)["top_logprobs"] == []
