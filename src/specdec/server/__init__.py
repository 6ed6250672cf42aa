"""OpenAI-compatible server: ``create_app(llm)`` (FastAPI) and ``specdec serve``."""

from specdec.server.app import create_app

__all__ = ["create_app"]
