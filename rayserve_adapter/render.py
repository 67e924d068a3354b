"""The ingress's own prompt renderer, for KV-event routing: a generate request's prompt token ids, computed where
the router runs.

A model replica hands over its tokenizer, its chat template (``--chat-template``, or None for the tokenizer's)
and its ``max_model_len`` once (``EngineReplica.render_spec``); from then on the ingress renders every request
itself, with the very functions the replica's routes use (``serving_chat.render_chat``, the tokenizer worker's
``encode``), so the ids are the ones the replica will run, and no request pays a round trip to a busy replica
before it is routed. A body that cannot be rendered gives None: it is routed by prefix affinity, and the
replica answers the client.

Torch-free, like the rest of the ingress's imports.
"""
from __future__ import annotations

from paged_runtime.entrypoints.openai.errors import parse_json
from paged_runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from paged_runtime.entrypoints.openai.serving import TokenizerWorker
from paged_runtime.entrypoints.openai.serving_chat import render_chat, template_kwargs, template_tools


class PromptRenderer:
    """Renders prompts as a replica does, on a tokenizer worker of its own (one thread, one tokenizer copy)."""

    def __init__(self, tokenizer: object, chat_template: str | None, max_model_len: int) -> None:
        self.worker = TokenizerWorker(tokenizer, max_model_len)
        self.chat_template = chat_template

    async def tokens(self, path: str, body: bytes) -> tuple[int, ...] | None:
        """The token ids of the (first) prompt of a ``/v1/completions`` or ``/v1/chat/completions`` body, or
        None for a body that cannot be rendered (the replica answers it with its 400)."""
        try:
            return await self.worker.run(self._tokens, path, body)
        except Exception:  # a 400 the replica will give, in whatever form: nothing to route on
            return None

    def _tokens(self, path: str, body: bytes) -> tuple[int, ...]:
        data = parse_json(body)
        if path.endswith("/chat/completions"):
            req = ChatCompletionRequest.model_validate(data)
            text = render_chat(self.worker.tokenizer, self.chat_template, req.messages, req.add_generation_prompt,
                               req.continue_final_message, template_kwargs(req), template_tools(req))
            return tuple(self.worker.encode(text, "messages", add_special_tokens=False))
        prompt = CompletionRequest.model_validate(data).prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch goes to one replica: route on its first prompt
        return tuple(prompt) if isinstance(prompt, list) else tuple(self.worker.encode(prompt))
