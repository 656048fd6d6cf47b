"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar."""

from engine.structured_output.manager import RequestGrammar, StepGrammars, StructuredOutputManager, default_manager
from engine.structured_output.spec import GrammarError, StructuredOutputSpec

__all__ = ["GrammarError", "RequestGrammar", "StepGrammars", "StructuredOutputManager", "StructuredOutputSpec", "default_manager"]
