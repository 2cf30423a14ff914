"""dhisparse: serving long-context sparse-attention LLMs over a load-adaptive KV hierarchy."""

from dhisparse.engine.config import EngineConfig
from dhisparse.core.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from dhisparse.engine.llm import LLM

        return LLM
    raise AttributeError(name)
