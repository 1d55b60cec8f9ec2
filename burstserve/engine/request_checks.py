"""What the front checks of a request before it queues it (engine/llm.py LLM.submit, the server's routes): the
prompt's tokens, whether it could ever fit in the KV cache, whether a prompt_logprobs prompt fits one call's
activations, the response_format. Read from the engine's options, the model, and the facts the workers reported
(engine/core/messages.py WorkerFacts); every refusal raises InvalidRequestError naming its parameter."""
from burstserve.engine.cache.ledger import pages_for
from burstserve.engine.core.errors import InvalidRequestError, PromptTooLongError
from burstserve.engine.core.messages import WorkerFacts
from burstserve.engine.core.placement import worker_share
from burstserve.engine.core.sampling import SamplingParams
from burstserve.engine.core.structured_output import (StructuredRequest, check_tokenizer, parse_response_format,
                                                 tokenizer_source)
from burstserve.engine.model.config import EngineConfig, ModelConfig

Prompt = str | list[int]


def prompt_list(prompts) -> list[Prompt]:
    """generate's prompts as a list: one prompt (a string or a list of token ids), or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of those",
                                  "prompts")
    return prompts


class RequestChecks:
    def __init__(self, engine: EngineConfig, model_config: ModelConfig, tokenizer, max_model_len: int,
                 facts: WorkerFacts):
        """facts: worker 0's (every worker's pool is alike)."""
        self.engine, self.model_config, self.tokenizer = engine, model_config, tokenizer
        self.max_model_len, self.facts = max_model_len, facts

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, checked against the vocabulary and max_model_len."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        return ids

    def fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises InvalidRequestError when a request could never fit in the KV cache, even alone: its
        largest share on one worker (a zigzag shard is at most one token over an even split, and decoded
        tokens go to the worker holding fewest) must fit in that worker's pages."""
        needed = min(prompt_tokens + max_tokens, self.max_model_len)
        facts = self.facts
        if pages_for(self._share(needed), facts.block_size) > facts.kv_pages_per_worker:
            raise InvalidRequestError(f"the request needs {needed} tokens of KV cache (a prompt of {prompt_tokens} "
                                      f"tokens plus max_tokens {max_tokens}), more than the engine's capacity of "
                                      f"{facts.kv_capacity_total} tokens", "max_tokens")

    def _share(self, tokens: int) -> int:
        """The most of a sequence's tokens one worker holds (engine/core/placement.py)."""
        return worker_share(tokens, self.engine.world_size, self.facts.placement.replicated_kv)

    def one_call(self, prompt_tokens: int, params: SamplingParams) -> None:
        """A prompt_logprobs request is prefilled in one call (its prompt is never chunked); with chunked
        prefill on flash-attn-4 the workers reserve activation memory for one chunk's tokens only
        (engine/pages/sizing.py prefill_rows_reserved), so a longer such prompt is refused, not run out of
        memory."""
        rows = self.facts.prefill_rows_max
        if params.prompt_logprobs is None or rows is None:
            return
        share = self._share(prompt_tokens)
        if share > rows:
            raise InvalidRequestError(
                f"prompt_logprobs needs the prompt prefilled in one call, and with --max-num-batched-tokens "
                f"{self.engine.max_num_batched_tokens} each worker holds activations for at most {rows} tokens at "
                f"once; this prompt of {prompt_tokens} tokens would put {share} on one worker. Send it without "
                f"prompt_logprobs (it is then prefilled in chunks), or serve with a larger --max-num-batched-tokens",
                "prompt_logprobs")

    def structured(self, params: SamplingParams) -> StructuredRequest | None:
        """What worker 0 needs to constrain a request to its response_format (None: unconstrained);
        raises InvalidRequestError (param "response_format") for a bad one or a model without a tokenizer."""
        spec = parse_response_format(params.response_format)   # again: params may have changed since built
        if spec is None:
            return None
        source = tokenizer_source(self.engine.model, self.engine.is_preset, self.model_config.vocab_size,
                                  self.model_config.eos_token_ids, self.tokenizer.eos_token_id)
        check_tokenizer(source, self.tokenizer)
        return StructuredRequest(spec, source)
