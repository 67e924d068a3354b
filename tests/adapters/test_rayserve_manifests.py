"""manifests/rayserve/: the Serve config and the RayService's serveConfigV2 pass Ray's own schema, every
import_path imports, and every application builds from its args (no cluster needed to build one).
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")

from ray._common.utils import import_attr  # noqa: E402
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # noqa: E402
from ray.serve.config import AutoscalingConfig  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "rayserve"


def load(name: str) -> dict:
    return yaml.safe_load((MANIFESTS / name).read_text())


def serve_configs() -> list[tuple[str, dict]]:
    rayservice = load("rayservice.yaml")
    return [("serve-config.yaml", load("serve-config.yaml")),
            ("rayservice.yaml serveConfigV2", yaml.safe_load(rayservice["spec"]["serveConfigV2"]))]


@pytest.mark.parametrize("name,config", serve_configs(), ids=lambda x: x if isinstance(x, str) else "")
def test_serve_config_is_valid_and_builds(name, config):
    schema = ServeDeploySchema.model_validate(config)
    assert schema.applications, name
    for application in schema.applications:
        builder = import_attr(application.import_path)
        built = call_user_app_builder_with_args_if_necessary(builder, application.args)
        deployment = built._bound_deployment
        assert deployment.name in ("PagedRuntimeServer", "PagedRuntimeIngress")
        names = {d.name for d in (application.deployments or [])}
        assert names <= {"PagedRuntimeServer", "PagedRuntimeIngress"}, f"{name}: overrides for unknown {names}"


def test_local_serve_config_binds_loopback_only():
    config = ServeDeploySchema.model_validate(load("serve-config.yaml"))
    assert config.http_options.host == "127.0.0.1"
    [application] = config.applications
    assert application.import_path == "rayserve_adapter:app" and application.route_prefix == "/"


def test_rayservice_shape():
    service = load("rayservice.yaml")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # replicas stay off the head
    [workers] = cluster["workerGroupSpecs"]
    pod = workers["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for spec, mounts in ((head["template"]["spec"], head["template"]["spec"]["containers"][0]["volumeMounts"]),
                         (pod, container["volumeMounts"])):
        shm = {m["name"] for m in mounts if m["mountPath"] == "/dev/shm"}
        assert shm and all(v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"] if v["name"] in shm)
    [application] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    args = application["args"]
    assert args["num_gpus"] == 1
    # The autoscaler asks for at most as many GPU replicas as the worker group can grow to.
    assert args["autoscaling_config"]["max_replicas"] <= workers["maxReplicas"]
    policy = AutoscalingConfig(**args["autoscaling_config"]).policy
    policy.get_policy()(**policy.policy_kwargs)  # the policy's kwargs are ones it takes
