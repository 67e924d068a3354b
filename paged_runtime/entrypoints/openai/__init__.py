"""OpenAI-compatible HTTP surface: one reusable router (``build_router``) and an app factory (``build_app``)."""
from paged_runtime.entrypoints.openai.api import build_app, build_router
from paged_runtime.entrypoints.openai.errors import OpenAIError

__all__ = ["build_app", "build_router", "OpenAIError"]
