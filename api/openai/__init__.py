"""The OpenAI-compatible API: its wire protocol (protocol.py) apart from serving it (routes.py)."""
