"""manifests/rayserve/: the Serve config and the RayServices' serveConfigV2 pass Ray's own schema, every
import_path imports, and every application builds from its args (no cluster needed to build one); the
multi-node example's ranks, bundles and pods agree.
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


RAYSERVICES = ("rayservice.yaml", "rayservice-tp2-pp2.yaml")


def serve_configs() -> list[tuple[str, dict]]:
    return [("serve-config.yaml", load("serve-config.yaml"))] + [
        (f"{name} serveConfigV2", yaml.safe_load(load(name)["spec"]["serveConfigV2"])) for name in RAYSERVICES]


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


def test_multi_node_rayservice_gives_each_rank_a_gpu_and_each_stage_a_node():
    from paged_runtime.entrypoints.cli import build_parser, engine_config
    from rayserve_adapter import AppArgs
    from rayserve_adapter.builder import model_options
    service = load("rayservice-tp2-pp2.yaml")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    [application] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    raw = application["args"]
    args = AppArgs.model_validate(raw)
    # The engine's names are the CLI's flags: the same engine as `paged-runtime serve` with these flags.
    cli = engine_config(build_parser().parse_args([
        "serve", "--tensor-parallel-size", str(raw["tensor_parallel_size"]), "--pipeline-parallel-size",
        str(raw["pipeline_parallel_size"]), "--distributed-executor-backend", "ray"]))
    config = args.engine_config()
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend"):
        assert getattr(config, name) == getattr(cli, name), name
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.device) == (2, 2, "cuda")
    options = model_options(args)
    assert options["placement_group_strategy"] == "PACK"  # stages may span nodes
    assert options["placement_group_bundles"] == [{"GPU": 1, "CPU": 2}] + [{"GPU": 1}] * 3
    assert options["ray_actor_options"] == {"num_cpus": 2}
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    [workers] = cluster["workerGroupSpecs"]
    pod = workers["template"]["spec"]
    [container] = pod["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus % config.tensor_parallel_size == 0  # a stage's ranks fit in one pod (PACK keeps them there)
    assert workers["minReplicas"] * gpus >= config.world_size * args.num_replicas
    assert int(container["resources"]["requests"]["cpu"]) >= args.num_cpus
    # The checkpoint is at the same path on every node: each rank loads its own shard.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert args.model.startswith("/models/") and "persistentVolumeClaim" in next(
        v for v in pod["volumes"] if v["name"] == mounts["/models"])
