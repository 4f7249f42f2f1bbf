"""statekeeper: keeps multi-turn LLM conversations cheap to resume."""

__version__ = "0.1.0"
