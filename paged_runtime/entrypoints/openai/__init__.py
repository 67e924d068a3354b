"""OpenAI-compatible HTTP surface: one reusable router (``build_router``), an app factory (``build_app``) and
its keywords from the server settings (``app_options``)."""
from paged_runtime.entrypoints.openai.api import app_options, build_app, build_router
from paged_runtime.entrypoints.openai.errors import OpenAIError

__all__ = ["app_options", "build_app", "build_router", "OpenAIError"]
