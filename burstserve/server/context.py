"""What every route handler is given: the engine, its async bridge and the served model's name."""
from dataclasses import dataclass

from burstserve.engine import LLM
from burstserve.server.async_engine import AsyncEngine
from burstserve.server.errors import APIError


@dataclass
class ServerContext:
    llm: LLM
    engine: AsyncEngine
    model_name: str

    def check_model(self, model: str | None) -> None:
        """A 404 (OpenAI's `model_not_found`, naming the model served) unless the request names it or none."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}` "
                                "(GET /v1/models lists it).", "model", code="model_not_found")
