"""dhisparse: serving long-context sparse-attention LLMs over a load-adaptive KV hierarchy.

The top-level API: `LLM`, `SamplingParams`, `EngineConfig`. It sits above `engine` and may import
`engine` and the rooms below it (docs/structure.md); `server`, `bench` and `cli` may import it.
"""

from dhisparse.engine.config import EngineConfig
from dhisparse.core.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`dhisparse.LLM` is imported on first use (PEP 562), not with the package: `engine.llm` pulls
    in the engine, the models, the KV stores and the kernels (~0.2 s more on a CPU machine), which
    every `import dhisparse.<room>` (the CLI's `--help` among them) would otherwise pay. The one
    function-level import the package allows outside `cli/` and `bench/` (tests/test_architecture.py)."""
    if name == "LLM":
        from dhisparse.engine.llm import LLM

        return LLM
    raise AttributeError(name)
