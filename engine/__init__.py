"""burstserve's engine: sequence-parallel BurstAttention prefill and distributed-KV decode."""
from engine.errors import (BurstServeError, ClusterError, DeviceSpecError, EngineDeadError, InvalidRequestError,
                           ModelLoadError, PromptTooLongError)
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BurstServeError", "ClusterError", "DeviceSpecError",
           "EngineDeadError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError"]
