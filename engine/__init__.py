"""Pagoda engine: everything between a request and a token."""

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in the model stack; keep `import engine` light for the server's cheap paths.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]
