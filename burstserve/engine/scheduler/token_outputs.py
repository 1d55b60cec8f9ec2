"""A sampled token's way out of the scheduler: the first token of a prompt (and a grammar row's token) sampled
from its logits on worker 0's device, the sequence's grammar advanced by it, the stop rules asked whether the
sequence ends, and the token sent to the caller: a decode step's tokens as one message, not one per token."""
import logging
import queue
from contextlib import contextmanager

import torch

from burstserve.engine.core.messages import Tokens
from burstserve.engine.core.outputs import FinishReason, Request, StepOutput
from burstserve.engine.core.sampling import rows_logprobs, sample_rows
from burstserve.engine.core.structured_output import GrammarBackend, SequenceGrammar, TokenizerSource, mask_logits
from burstserve.engine.scheduler.sequences import RunningSequence

log = logging.getLogger(__name__)


class TokenOutputs:
    def __init__(self, outputs: "queue.Queue", device: torch.device, eos_token_ids: list[int], max_model_len: int):
        """outputs: the engine's queue of messages (engine/core/messages.py); device: where tokens are sampled."""
        self.outputs, self.device = outputs, device
        self.eos_token_ids, self.max_model_len = set(eos_token_ids), max_model_len
        self.grammars: dict[TokenizerSource, GrammarBackend] = {}   # built at the first response_format
        self._step: list[StepOutput] | None = None                   # collecting a decode step's outputs

    def new_grammar(self, request: Request) -> SequenceGrammar | None:
        """A fresh matcher for a constrained request (each of n choices has its own); the grammar is
        compiled at the first request with this response_format, then taken from the cache."""
        if request.structured is None:
            return None
        source = request.structured.source
        backend = self.grammars.get(source)
        if backend is None:
            backend = self.grammars[source] = GrammarBackend(source)
        return backend.matcher(request.structured.spec)

    def sample(self, seq: RunningSequence, logits: torch.Tensor,
               sample_logits: torch.Tensor | None = None) -> tuple[int, dict | None]:
        """logits [V] -> (token, its logprobs entry or None). Samples from `sample_logits` (the grammar-masked
        logits) when given or when the sequence has a grammar, else from `logits`; the logprobs are always the
        model's own (unmasked) `logits`."""
        params = seq.request.params
        if sample_logits is None and seq.grammar is not None:
            sample_logits = mask_logits(logits.unsqueeze(0).clone(), [seq.grammar])[0]
        # on worker 0's device, as decode steps sample: a seeded request's noise is the same whichever draws it
        source = (logits if sample_logits is None else sample_logits).to(self.device)
        token = sample_rows(source[None], [seq.sampling()])
        logprobs = rows_logprobs(logits[None], token.cpu(), [params.logprobs])[0] if params.logprobs is not None else None
        return int(token[0]), logprobs

    def accept(self, seq: RunningSequence, token: int) -> FinishReason | None:
        """Advances the sequence's grammar (if any) by its new token -> why the sequence ends, or None: it runs
        on."""
        params = seq.request.params
        grammar_ended = False
        if seq.grammar is not None:
            if not seq.grammar.accept(token):   # cannot happen with a masked sample; never run on off-grammar
                log.error("request %s: token %d does not match its response_format; ending it",
                          seq.request.request_id, token)
                return FinishReason.ABORT
            grammar_ended = seq.grammar.terminated   # its stop token accepted: ends even with ignore_eos
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos) or grammar_ended:
            return FinishReason.STOP
        return FinishReason.LENGTH if seq.ends_by_length(len(seq.generated), self.max_model_len) else None

    def send(self, item: StepOutput) -> None:
        """One token out: with the step's others inside `one_message`, else at once."""
        if self._step is not None:
            self._step.append(item)
        else:
            self.outputs.put(Tokens([item]))

    @contextmanager
    def one_message(self):
        """The tokens sent inside go out as one message (one pickle and queue put per step, not per token)."""
        self._step = []
        yield
        items, self._step = self._step, None
        self.outputs.put(Tokens(items))
