"""The runtime as a KServe model server: v1 ``:predict``, v2 ``/infer`` and the OpenAI routes, no vLLM needed.

Run it with ``python -m kserve_adapter --model_name NAME [--model_dir /mnt/models]``
(KServe's ``manifests/kserve/`` runtime does). Modules: ``args`` (flags),
``model`` (the ``kserve.Model``), ``protocol`` (v1/v2 mapping),
``openai_routes`` (the OpenAI router on KServe's app), ``server`` (wiring).
"""
