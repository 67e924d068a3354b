"""The runtime as a Ray Serve application, on plain ``ray[serve]`` (Ray's own LLM package imports vLLM).

``serve run rayserve_adapter:app [model=PATH max_num_seqs=64 num_replicas=2 ...]``
serves the OpenAI routes; the same arguments go under ``args:`` in a Serve
config or a KubeRay ``serveConfigV2`` (see ``manifests/rayserve/``).

Modules: ``args`` (the validated arguments), ``builder`` (the application and
its deployment options), ``deployment`` (the model replica owning one engine,
and the ingress), ``router`` (prefix-aware routing), ``autoscaling`` (the
policy on engine signals), ``asgi`` (requests across a DeploymentHandle),
``lora`` (LoRA adapters: their names at the ingress, multiplexed routing).
"""
from rayserve_adapter.args import AppArgs
from rayserve_adapter.builder import app

__all__ = ["app", "AppArgs"]
