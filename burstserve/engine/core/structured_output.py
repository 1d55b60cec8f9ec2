"""Structured output: OpenAI's `response_format` as a grammar (xgrammar) that masks the sampled token.

Three parts, in the order a request meets them:

* `parse_response_format` (front end, from `SamplingParams.validate` and again in `LLM.submit`):
  checks the object's shape and that xgrammar can turn the schema into a grammar, and returns a
  `GrammarSpec` (None: no constraint). Every mistake is an InvalidRequestError on "response_format".
* `GrammarBackend` (worker 0, one per tokenizer): the tokenizer's `xgrammar.TokenizerInfo`, a
  `GrammarCompiler`, and an LRU of compiled grammars keyed by the spec's canonical JSON, so each
  distinct response_format is compiled once.
* `SequenceGrammar` (one per running sequence, also for each of n choices): the matcher's state.
  `mask_logits` fills the allowed-token bitmask of several sequences and applies it to their logits
  rows with xgrammar's own functions (no Python loop over the vocabulary); `accept` advances the
  state with the sampled token; `terminated` is true once the grammar is complete and a stop token
  was accepted.

The grammars: `json_object` is xgrammar's builtin JSON grammar with an object at the top level;
`json_schema` is xgrammar's JSON-schema grammar, strict (no properties the schema does not name) and
with no free whitespace (`any_whitespace=False`: `{"a": 1, "b": [2, 3]}`), so a model cannot loop on
whitespace and outputs of a bounded schema are bounded. The grammar ends with a stop token (the
model's EOS ids and the tokenizer's EOS), which the mask allows only where the JSON is complete.
"""
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import torch

from burstserve.engine.core.errors import InvalidRequestError

log = logging.getLogger(__name__)

PARAM = "response_format"
TYPES = ("text", "json_object", "json_schema")
GRAMMAR_CACHE_SIZE = 64            # compiled grammars kept per tokenizer on worker 0 (LRU)
COMPILER_THREADS = 4
JSON_SCHEMA_OPTIONS = dict(any_whitespace=False, strict_mode=True)
_OBJECT_ROOT = 'root ::= ("{" [ \\n\\r\\t]* members_and_embrace)'   # the builtin grammar's object branch


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: kind "json_object" (schema None) or "json_schema" (schema: its JSON text)."""
    kind: str
    schema: str | None = None

    @property
    def key(self) -> str:
        """The canonical JSON of the constraint: the compiled-grammar cache's key."""
        return json.dumps([self.kind, self.schema], separators=(",", ":"))


@dataclass(frozen=True)
class TokenizerSource:
    """How worker 0 rebuilds the engine's tokenizer for xgrammar (small, sent with each request)."""
    model: str                      # a preset name or a model directory
    is_preset: bool                 # presets: the byte tokenizer
    vocab_size: int                 # the model's (the mask's width); may exceed the tokenizer's
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StructuredRequest:
    """Attached to a Request by LLM.submit when its response_format constrains the output."""
    spec: GrammarSpec
    source: TokenizerSource


# ---- front end: validation ---------------------------------------------------------------------
def parse_response_format(response_format) -> GrammarSpec | None:
    """None for no constraint (None or {"type": "text"}); raises InvalidRequestError("...", "response_format")."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequestError(f"response_format must be an object with a 'type', not "
                                  f"{type(response_format).__name__}", PARAM)
    kind = response_format.get("type")
    if kind not in TYPES:
        raise InvalidRequestError(f"response_format type {kind!r} is not supported; use one of "
                                  f"{', '.join(TYPES)}", PARAM)
    if kind == "text":
        return None
    if kind == "json_object":
        spec = GrammarSpec("json_object")
    else:
        spec = GrammarSpec("json_schema", _schema_text(response_format.get("json_schema")))
    _check_grammar(spec)
    return spec


def _schema_text(json_schema) -> str:
    if not isinstance(json_schema, dict):
        raise InvalidRequestError("a response_format of type json_schema needs a 'json_schema' object with a "
                                  "'schema'", PARAM)
    if "schema" not in json_schema:
        raise InvalidRequestError("response_format.json_schema has no 'schema' (the JSON Schema the output "
                                  "must match)", PARAM)
    schema = json_schema["schema"]
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"response_format.json_schema.schema must be a JSON Schema object, not "
                                  f"{type(schema).__name__}", PARAM)
    for name, kind in (("name", str), ("description", str), ("strict", bool)):
        value = json_schema.get(name)
        if value is not None and not isinstance(value, kind):
            raise InvalidRequestError(f"response_format.json_schema.{name} must be a {kind.__name__}, not "
                                      f"{type(value).__name__}", PARAM)
    try:   # key order kept: the schema's property order is the output's
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"response_format.json_schema.schema is not JSON: {e}", PARAM) from e


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _grammar_error(spec: GrammarSpec) -> str | None:
    try:
        grammar(spec)
    except Exception as e:   # xgrammar raises RuntimeError/ValueError/its own types for bad schemas
        lines = str(e).strip().splitlines() or [type(e).__name__]
        return re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", lines[0])[:500]   # without "[time] file.cc:line: "
    return None


def _check_grammar(spec: GrammarSpec) -> None:
    error = _grammar_error(spec)
    if error is not None:
        raise InvalidRequestError(f"response_format.json_schema.schema cannot be compiled to a grammar: {error}",
                                  PARAM)


def grammar(spec: GrammarSpec):
    """The spec's xgrammar.Grammar (tokenizer-independent)."""
    import xgrammar as xgr
    if spec.kind == "json_object":
        return _json_object_grammar()
    return xgr.Grammar.from_json_schema(spec.schema, **JSON_SCHEMA_OPTIONS)


@lru_cache(maxsize=1)
def _json_object_grammar():
    """xgrammar's builtin JSON grammar, whose root is an object or an array, with the object only."""
    import xgrammar as xgr
    builtin = str(xgr.Grammar.builtin_json_grammar())
    lines = builtin.splitlines()
    root = next((i for i, line in enumerate(lines) if line.startswith("root ::=")), None)
    if root is not None and "members_and_embrace" in lines[root]:
        lines[root] = _OBJECT_ROOT
        try:
            return xgr.Grammar.from_ebnf("\n".join(lines))
        except Exception:   # a future xgrammar printing its grammar differently: the schema form below
            log.warning("cannot restrict xgrammar's builtin JSON grammar to objects; using {'type': 'object'}")
    return xgr.Grammar.from_json_schema('{"type":"object"}', strict_mode=False)


def tokenizer_source(model: str, is_preset: bool, vocab_size: int, eos_token_ids: list[int],
                     tokenizer_eos: int | None) -> TokenizerSource:
    """The stop tokens are the model's EOS ids and the tokenizer's EOS: those that end a sequence."""
    stops = {t for t in [*eos_token_ids, tokenizer_eos] if t is not None and 0 <= t < vocab_size}
    return TokenizerSource(model, is_preset, vocab_size, tuple(sorted(stops)))


_checked_sources: dict[TokenizerSource, str | None] = {}
_checked_lock = threading.Lock()


def check_tokenizer(source: TokenizerSource, tokenizer) -> None:
    """Raises InvalidRequestError when xgrammar cannot use the engine's tokenizer (once per tokenizer:
    worker 0 builds the same TokenizerInfo, so it must not fail there)."""
    with _checked_lock:
        if source not in _checked_sources:
            try:
                tokenizer_info(tokenizer, source)
                _checked_sources[source] = None
            except InvalidRequestError as e:
                _checked_sources[source] = str(e)
            except Exception as e:
                _checked_sources[source] = f"structured output is not available for this model's tokenizer: " \
                                           f"{type(e).__name__}: {e}"
        error = _checked_sources[source]
    if error is not None:
        raise InvalidRequestError(error, PARAM)


# ---- worker 0: tokenizer info, compiled grammars, matchers --------------------------------------
def tokenizer_info(tokenizer, source: TokenizerSource):
    """xgrammar.TokenizerInfo of the engine's tokenizer, its mask as wide as the model's vocabulary."""
    import xgrammar as xgr
    from burstserve.engine.core.tokenizer import ByteTokenizer, HFTokenizer
    stops = list(source.stop_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        # ids 0-255 are the raw bytes; BOS/EOS (and every unused id above them) decode to nothing: special
        specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, *stops]
        vocab = [bytes([i]) for i in range(256)] + [b""] * (max(specials) + 1 - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=source.vocab_size,
                                 stop_token_ids=stops or [tokenizer.eos_token_id])
    if isinstance(tokenizer, HFTokenizer):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.tok, vocab_size=source.vocab_size,
                                                  stop_token_ids=stops or None)
        # xgrammar takes only empty tokens as special; the tokenizer's special tokens (<s>, chat markers)
        # would otherwise be text the grammar could put in a JSON string, and decoding drops them
        special = {i for i in tokenizer.tok.all_special_ids if 0 <= i < source.vocab_size}
        if not special:
            return info
        vocab = [""] * source.vocab_size
        for token, i in tokenizer.tok.get_vocab().items():
            if 0 <= i < source.vocab_size and i not in special:
                vocab[i] = token
        return xgr.TokenizerInfo(vocab, info.vocab_type, vocab_size=source.vocab_size,
                                 stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space)
    raise InvalidRequestError("response_format needs the model's tokenizer, and this model directory has no "
                              "tokenizer files", PARAM)


class GrammarBackend:
    """Worker 0's xgrammar state for one tokenizer: the compiler and an LRU of compiled grammars."""

    def __init__(self, source: TokenizerSource, tokenizer=None):
        import xgrammar as xgr
        if tokenizer is None:
            from burstserve.engine.core.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(source.model, source.is_preset)
        self.info = tokenizer_info(tokenizer, source)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=COMPILER_THREADS, cache_enabled=False)
        self.cache: OrderedDict[str, object] = OrderedDict()
        self.compiles = 0                      # how many grammars were compiled (the cache's misses)

    def compiled(self, spec: GrammarSpec):
        key = spec.key
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        compiled = self.compiler.compile_grammar(grammar(spec))
        self.compiles += 1
        self.cache[key] = compiled
        if len(self.cache) > GRAMMAR_CACHE_SIZE:
            self.cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> "SequenceGrammar":
        return SequenceGrammar(self.compiled(spec))


class SequenceGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, compiled):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)   # ends on a stop token (terminate_without_stop_token False)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Writes the allowed next tokens into bitmask[row]; False when every token is allowed."""
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def mask_logits(rows: torch.Tensor, grammars: list[SequenceGrammar]) -> torch.Tensor:
    """In place: rows [k, V] (row i for grammars[i]) get -inf at every token grammar i does not allow next.
    Pass a copy: the model's logits themselves stay unmasked (logprobs are the model's distribution)."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(grammars), rows.shape[-1])
    needed = [i for i, g in enumerate(grammars) if g.fill_bitmask(bitmask, i)]
    if needed:
        xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device), vocab_size=rows.shape[-1], indices=needed)
    return rows
