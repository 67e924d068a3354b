"""POST /v1/embeddings on a ``--runner pooling`` engine: OpenAI's request and response.

``input`` is a string, a list of strings, a token-id list or a list of them; each is one pooling request
(bounded like the completions prompt list by ``max_prompts_per_request``). ``dimensions`` keeps the first
entries of each vector (Matryoshka) and re-normalises when normalising; above the hidden size it is a 400.
``encoding_format`` "base64" sends each vector as base64 of its little-endian float32 bytes, as OpenAI.
Usage counts the prompt tokens (there are no completion tokens). A generative engine answers 400.
"""
from __future__ import annotations

import base64

import numpy as np

from paged_runtime.entrypoints.openai.errors import bad_request, from_parameter_error
from paged_runtime.entrypoints.openai.protocol import EmbeddingRequest
from paged_runtime.entrypoints.openai.serving import OpenAIServing, collect, new_id
from paged_runtime.engine.processor import ProcessedPrompt
from paged_runtime.outputs import RequestOutput
from paged_runtime.sampling_params import ParameterError, RequestOutputKind, SamplingParams

ROUTE = "/v1/embeddings"


class EmbeddingServing(OpenAIServing):
    async def create(self, req: EmbeddingRequest) -> dict:
        model = self.resolve_model(req.model)
        if not self.engine.config.is_pooling:
            raise bad_request(f"{ROUTE} needs a pooling model; this server runs its model as a generator (start "
                              "it with --runner pooling to embed)", code="unsupported_model")
        try:
            pooling = self.engine.pooling_params(req.dimensions, req.normalize)
        except ParameterError as e:
            raise from_parameter_error(e) from e
        params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        processed = [await self.process_off_loop(p, params, "input") for p in self.prompt_list(req.input, "input")]
        outputs = await collect(self.submit(new_id("embd"), processed, params, req, pooling))
        return _response(req, model, processed, outputs)


def _response(req: EmbeddingRequest, model: str, processed: list[ProcessedPrompt],
              outputs: list[RequestOutput]) -> dict:
    data = []
    for index, out in enumerate(outputs):
        vector = out.pooling.data
        embedding = (base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
                     if req.encoding_format == "base64" else vector)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    num_prompt_tokens = sum(len(p.token_ids) for p in processed)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}
