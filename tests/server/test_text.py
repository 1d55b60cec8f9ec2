"""TextAssembler: what a stream sends is a stable prefix, a stop string cuts exactly where the uncut
text has it, and valid text comes back whole; with fresh random tokens, invalid UTF-8 included."""
import random

import pytest

from burstserve.engine.core.tokenizer import ByteTokenizer, HFTokenizer
from hf_reference import save_tokenizer
from burstserve.server.text import TextAssembler


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    save_tokenizer(path)
    return {"bytes": ByteTokenizer(), "bpe": HFTokenizer(path)}


def assemble(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, list[str]]:
    assembler = TextAssembler(tokenizer, stops)
    pieces = []
    for t in ids:
        pieces.append(assembler.add(t))
        if assembler.stopped:
            break
    pieces.append(assembler.finish())
    return "".join(pieces), pieces


def random_ids(rng: random.Random, name: str, n: int) -> list[int]:
    """Mostly printable bytes with UTF-8 lead and continuation bytes mixed in (so some characters
    are cut, some invalid); the BPE tokenizer also gets its letter-pair tokens (258-319)."""
    pool = list(range(32, 127)) * 3 + list(range(0x80, 0x100))
    if name == "bpe":
        pool += list(range(258, 320)) * 2
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("name", ["bytes", "bpe"])
def test_stop_string_cuts_where_the_uncut_text_has_it(tokenizers, name):
    rng = random.Random()
    tok, checked = tokenizers[name], 0
    for _ in range(300):
        ids = random_ids(rng, name, rng.randrange(1, 40))
        full, _ = assemble(tok, ids, [])
        if len(full) < 2:
            continue
        start = rng.randrange(len(full) - 1)
        stop = full[start:start + rng.randrange(1, 4)]
        cut, _ = assemble(tok, ids, [stop, "never-generated-\x00"])
        assert cut == full[:full.find(stop)], (ids, stop)
        checked += 1
    assert checked > 200


@pytest.mark.parametrize("name", ["bytes", "bpe"])
def test_valid_text_comes_back_whole_and_pieces_never_change(tokenizers, name):
    rng = random.Random()
    tok = tokenizers[name]
    alphabet = "etaoin shrd,.\nÄé中文😀"
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        ids = [t for t in tok.encode(text) if t != tok.bos_token_id]
        full, pieces = assemble(tok, ids, [])
        assert full == text
        assert all("\ufffd" not in p for p in pieces)   # a cut character is held until it is whole


def test_hold_back_releases_text_that_cannot_start_a_stop(tokenizers):
    tok = tokenizers["bytes"]
    assembler = TextAssembler(tok, ["xyz"])
    sent = "".join(assembler.add(b) for b in b"hello wor")
    assert sent == "hello w"          # the last two characters could still begin "xyz"
    assert assembler.add(ord("x")) == "o"
    assert assembler.add(ord("y")) == "r"
    assert assembler.add(ord("z")) == "" and assembler.stopped
    assert assembler.finish() == ""
