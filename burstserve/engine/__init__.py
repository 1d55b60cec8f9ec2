"""burstserve's engine: sequence-parallel BurstAttention prefill and distributed-KV decode."""
from burstserve.engine.errors import (BurstServeError, ClusterError, DeviceSpecError, EngineDeadError,
                                      InvalidRequestError, ModelLoadError, PromptTooLongError)
from burstserve.engine.llm import LLM
from burstserve.engine.outputs import CompletionOutput, RequestOutput
from burstserve.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BurstServeError", "ClusterError", "DeviceSpecError",
           "EngineDeadError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError"]
