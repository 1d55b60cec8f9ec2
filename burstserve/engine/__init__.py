"""burstserve's engine: sequence-parallel BurstAttention prefill and distributed-KV decode."""
from burstserve.engine.core.errors import (BurstServeError, ClusterError, DeviceSpecError, EngineDeadError,
                                      InvalidRequestError, ModelLoadError, PromptTooLongError)
from burstserve.engine.core.outputs import CompletionOutput, RequestOutput
from burstserve.engine.core.sampling import SamplingParams
from burstserve.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BurstServeError", "ClusterError", "DeviceSpecError",
           "EngineDeadError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError"]
