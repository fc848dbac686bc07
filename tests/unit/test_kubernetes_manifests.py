"""deploy/kubernetes: every overlay renders, validates offline against the Kubernetes schemas, and
its ConfigMap is a config the services accept whose workers and cache pools are exactly the rendered
pods."""
import inspect
import re
from pathlib import Path, PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.cache_pool.cli import serve_cache_pool
from services.config import DeploymentConfig, parse_config
from services.engine.serve import serve_worker
from services.kv_transport.settings import TransportSettings
from services.router.serve import SHUTDOWN_GRACE_S
from support.kustomize import CLUSTER_ROLES, Rendered, deployments, render

OLDEST_KUBERNETES = "1.29.0"
VERSIONS = (OLDEST_KUBERNETES, kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    # Only the fields these manifests use; checked structurally (the CRD is not in the package).
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"]},
                    "endpoints": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["port"],
                        "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                       "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"}}}},
                },
            },
        },
    },
}
SUBCOMMANDS = {"prefill_worker": "prefill-worker", "decode_worker": "decode-worker"}
CLUSTER_ROLE_OF = {"prfaas": "prfaas-cluster", "local": "local-cluster"}
POOL_COMPONENT = "cache-pool"
# The pool process' own memory on top of memory_budget_gib (Python, gRPC buffers of in-flight calls).
MIN_POOL_OVERHEAD_BYTES = 2**30
QUANTITY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                     "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
ROLES = [(d, r) for d in deployments() for r in CLUSTER_ROLES]


def config_of(rendered: Rendered) -> DeploymentConfig:
    (config_map,) = rendered.of_kind("ConfigMap")
    return parse_config(yaml.safe_load(config_map["data"]["config.yaml"]))


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def container_ports(workload: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(workload)["ports"]}


def service_ports(rendered: Rendered, name: str) -> dict[str, int]:
    return {p["name"]: p["port"] for p in rendered.one("Service", name)["spec"]["ports"]}


def is_pool(workload: dict) -> bool:
    return workload["metadata"]["labels"]["app.kubernetes.io/component"] == POOL_COMPONENT


def pods(deployment: str, pools: bool = False) -> dict[str, tuple[Rendered, dict]]:
    """Pod name -> (its cluster role's render, its StatefulSet), over both cluster roles: the workers'
    pods, or with ``pools`` the cache pools' pods."""
    found = {}
    for role in CLUSTER_ROLES:
        rendered = render(deployment, role)
        for sts in rendered.of_kind("StatefulSet"):
            if is_pool(sts) != pools:
                continue
            for i in range(sts["spec"]["replicas"]):
                found[f"{sts['metadata']['name']}-{i}"] = (rendered, sts)
    return found


def quantity_bytes(quantity: str) -> int:
    for suffix, factor in QUANTITY_SUFFIXES.items():
        if quantity.endswith(suffix):
            return int(float(quantity[:-len(suffix)]) * factor)
    return int(quantity)


def test_quantities_parse():
    assert quantity_bytes("3Gi") == 3 * 2**30
    assert quantity_bytes("2Ti") == 2 * 2**40
    assert quantity_bytes("1500M") == 1_500_000_000


def env_of(workload: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(workload).get("env", [])}


def test_there_are_overlays_to_check():
    assert {"small", "case-study"} <= set(deployments())


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("deployment, role", ROLES)
def test_manifests_validate_against_kubernetes_schemas(deployment, role, version):
    for manifest in render(deployment, role).manifests:
        if manifest["kind"] in CRD_SCHEMAS:
            jsonschema.validate(manifest, CRD_SCHEMAS[manifest["kind"]])
        else:
            kubernetes_validate.validate(manifest, version, strict=True)


def test_strict_validation_refuses_an_unknown_field():
    service = dict(render("small", "local-cluster").one("Service", "router"))
    service["spec"] = {**service["spec"], "portz": []}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, OLDEST_KUBERNETES, strict=True)


@pytest.mark.parametrize("deployment", deployments())
def test_service_monitor_selects_the_router_http_port(deployment):
    rendered = render(deployment, "local-cluster")
    monitor = rendered.one("ServiceMonitor", "router")
    router = rendered.one("Service", "router")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= router["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= set(service_ports(rendered, "router"))
    annotations = rendered.one("Deployment", "router")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == container_ports(rendered.one("Deployment", "router"))["http"]


@pytest.mark.parametrize("deployment", deployments())
def test_both_clusters_get_the_same_config_and_it_loads(deployment):
    config_maps = [render(deployment, role).of_kind("ConfigMap") for role in CLUSTER_ROLES]
    assert config_maps[0] == config_maps[1]
    for role in CLUSTER_ROLES:
        rendered = render(deployment, role)
        config_of(rendered)
        for workload in rendered.of_kind("StatefulSet") + rendered.of_kind("Deployment"):
            command = container(workload)["command"]
            volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
            mounts = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
            config_path = PurePosixPath(command[command.index("--config") + 1])
            assert volumes["config"]["configMap"]["name"] == config_maps[0][0]["metadata"]["name"]
            assert config_path == PurePosixPath(mounts["config"]) / "config.yaml"


@pytest.mark.parametrize("deployment", deployments())
def test_every_worker_is_a_pod_and_every_pod_a_worker(deployment):
    config = config_of(render(deployment, "local-cluster"))
    found = pods(deployment)
    assert sorted(w.name for w in config.workers) == sorted(found)
    for worker in config.workers:
        rendered, sts = found[worker.name]
        namespace, service = sts["metadata"]["namespace"], sts["spec"]["serviceName"]
        assert worker.host == f"{worker.name}.{service}.{namespace}.svc.cluster.local"
        assert rendered.role == CLUSTER_ROLE_OF[worker.cluster]
        command = container(sts)["command"]
        assert command[1] == SUBCOMMANDS[worker.service]
        assert command[command.index("--name") + 1] == "$(POD_NAME)"
        assert env_of(sts)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert command[command.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize("deployment", deployments())
def test_every_cache_pool_is_a_pod_and_every_pool_pod_a_cache_pool(deployment):
    config = config_of(render(deployment, "local-cluster"))
    found = pods(deployment, pools=True)
    assert sorted(p.name for p in config.cache_pools) == sorted(found)
    assert {p.cluster for p in config.cache_pools} == set(CLUSTER_ROLE_OF)   # one pool per cluster role
    for pool in config.cache_pools:
        rendered, sts = found[pool.name]
        namespace, service = sts["metadata"]["namespace"], sts["spec"]["serviceName"]
        assert sts["spec"]["replicas"] == 1
        assert rendered.one("Service", service)["spec"]["clusterIP"] == "None"
        assert pool.host == f"{pool.name}.{service}.{namespace}.svc.cluster.local"
        assert rendered.role == CLUSTER_ROLE_OF[pool.cluster]
        command = container(sts)["command"]
        assert command[:2] == ["prfaas", "cache-pool"]
        assert command[command.index("--name") + 1] == "$(POD_NAME)"
        assert env_of(sts)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert "nvidia.com/gpu" not in container(sts)["resources"].get("limits", {})


@pytest.mark.parametrize("deployment", deployments())
def test_cache_pool_ports_match_containers_services_probes_and_scraping(deployment):
    config = config_of(render(deployment, "local-cluster"))
    found = pods(deployment, pools=True)
    all_services = [s for role in CLUSTER_ROLES for s in render(deployment, role).of_kind("Service")]
    for pool in config.cache_pools:
        rendered, sts = found[pool.name]
        service = rendered.one("Service", sts["spec"]["serviceName"])
        ports = container_ports(sts)
        assert ports["grpc"] == pool.port == service_ports(rendered, service["metadata"]["name"])["grpc"]
        assert pool.health_port is not None and ports["health"] == pool.health_port
        for probe in ("readinessProbe", "livenessProbe"):
            assert container(sts)[probe]["grpc"]["port"] == pool.health_port
        assert pool.metrics_port is not None, "the pool's metrics are scraped"
        assert ports["metrics"] == pool.metrics_port == service_ports(rendered, service["metadata"]["name"])["metrics"]
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == pool.metrics_port
        # The Service selects this pool's pod only, and this role's ServiceMonitor this Service only:
        # both roles' pools may share a namespace (the `small` overlay).
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        for other_sts in (s for _, s in found.values() if s is not sts):
            other_labels = other_sts["spec"]["template"]["metadata"]["labels"]
            assert not service["spec"]["selector"].items() <= other_labels.items()
        (monitor,) = [m for m in rendered.of_kind("ServiceMonitor")
                      if m["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()]
        selected = [s for s in all_services
                    if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert selected == [service]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics"}


@pytest.mark.parametrize("deployment", deployments())
def test_cache_pool_memory_and_ssd_fit_the_budgets(deployment):
    config = config_of(render(deployment, "local-cluster"))
    found = pods(deployment, pools=True)
    for pool in config.cache_pools:
        _, sts = found[pool.name]
        resources = container(sts)["resources"]
        memory = quantity_bytes(resources["limits"]["memory"])
        assert quantity_bytes(resources["requests"]["memory"]) == memory, "request = limit: no eviction under pressure"
        assert memory >= pool.memory_budget_bytes + MIN_POOL_OVERHEAD_BYTES, pool.name
        if pool.ssd_dir is None:
            continue
        mounts = {m["name"]: PurePosixPath(m["mountPath"]) for m in container(sts)["volumeMounts"]}
        (volume_name,) = [n for n, path in mounts.items()
                          if PurePosixPath(pool.ssd_dir).is_relative_to(path) and n != "config"]
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"].get("volumes", [])}
        claims = {c["metadata"]["name"]: c for c in sts["spec"].get("volumeClaimTemplates", [])}
        if volume_name in claims:
            assert volume_name not in volumes
            size = claims[volume_name]["spec"]["resources"]["requests"]["storage"]
        else:
            size = volumes[volume_name]["emptyDir"]["sizeLimit"]
        assert quantity_bytes(size) >= pool.ssd_budget_bytes, pool.name


@pytest.mark.parametrize("deployment", deployments())
def test_worker_ports_match_containers_services_and_probes(deployment):
    config = config_of(render(deployment, "local-cluster"))
    found = pods(deployment)
    for worker in config.workers:
        rendered, sts = found[worker.name]
        ports = container_ports(sts)
        assert ports["grpc"] == worker.port == service_ports(rendered, sts["spec"]["serviceName"])["grpc"]
        assert ports.get("kv") == worker.kv_port
        if worker.kv_port is not None:
            assert service_ports(rendered, sts["spec"]["serviceName"])["kv"] == worker.kv_port
        # The kubelet's gRPC probes cannot do TLS: they go to the plaintext health-only port.
        assert worker.health_port is not None and container_ports(sts)["health"] == worker.health_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container(sts)[probe]["grpc"]["port"] == worker.health_port


@pytest.mark.parametrize("deployment", deployments())
def test_gpus_per_pod_match_tensor_parallelism(deployment):
    config = config_of(render(deployment, "local-cluster"))
    found = pods(deployment)
    for worker in config.workers:
        resources = container(found[worker.name][1])["resources"]
        gpus = config.engine_for(worker).tensor_parallel_size
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == gpus


@pytest.mark.parametrize("deployment", deployments())
def test_router_port_api_keys_and_probes(deployment):
    rendered = render(deployment, "local-cluster")
    config, router = config_of(rendered), rendered.one("Deployment", "router")
    assert container_ports(router)["http"] == config.router.port == service_ports(rendered, "router")["http"]
    assert env_of(router)[config.router.api_keys_env]["valueFrom"]["secretKeyRef"]["name"] == "prfaas-secrets"
    assert container(router)["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    (hpa,) = rendered.of_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "router"


@pytest.mark.parametrize("deployment", deployments())
def test_every_service_gets_the_grpc_token_from_the_secret(deployment):
    config = config_of(render(deployment, "local-cluster"))
    workloads = [sts for _, sts in pods(deployment, pools=True).values()]
    workloads.append(render(deployment, "local-cluster").one("Deployment", "router"))
    for workload in workloads:
        secret_ref = env_of(workload)[config.security.token_env]["valueFrom"]["secretKeyRef"]
        assert secret_ref == {"name": "prfaas-secrets", "key": "grpc-token"}, workload["metadata"]["name"]


@pytest.mark.parametrize("deployment", deployments())
def test_workers_get_the_kv_secret_and_tls_files_from_secrets(deployment):
    config = config_of(render(deployment, "local-cluster"))
    transport = TransportSettings.of(config.transport)
    for _rendered, sts in pods(deployment).values():
        assert not is_pool(sts)
        secret_ref = env_of(sts)[transport.secret_env]["valueFrom"]["secretKeyRef"]
        assert secret_ref == {"name": "prfaas-secrets", "key": "kv-secret"}
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        secret_dirs = {PurePosixPath(m["mountPath"]) for m in container(sts)["volumeMounts"]
                       if "secret" in volumes[m["name"]]}
        for path in filter(None, (transport.tls_cert, transport.tls_key, transport.tls_ca)):
            assert PurePosixPath(path).parent in secret_dirs, path


@pytest.mark.parametrize("deployment, role", ROLES)
def test_termination_grace_covers_the_drain(deployment, role):
    worker_drain_s = inspect.signature(serve_worker).parameters["grace_s"].default
    pool_drain_s = inspect.signature(serve_cache_pool).parameters["grace_s"].default
    rendered = render(deployment, role)
    for workload in rendered.of_kind("StatefulSet") + rendered.of_kind("Deployment"):
        if workload["kind"] == "Deployment":
            drain_s = SHUTDOWN_GRACE_S
        else:
            drain_s = pool_drain_s if is_pool(workload) else worker_drain_s
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s


ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILES = [ROOT / "deploy/container/Containerfile", ROOT / "deploy/container/Containerfile.cuda"]



def _port_range(item: str) -> range:
    """An EXPOSE item: a port or a range ``first-last``."""
    first, _, last = item.partition("-")
    return range(int(first), int(last or first) + 1)

def containerfile_facts(path: Path) -> dict:
    text = path.read_text()
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    exposed = {port for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for item in line.split()
               for port in _port_range(item)}
    cache_dir = re.search(r"PRFAAS_CACHE_DIR=(\S+)", text)
    return {"uid": int(user[1]), "gid": int(user[2]), "exposed": exposed, "cache_dir": cache_dir[1]}


def test_the_image_build_tags_the_projects_version():
    script = (ROOT / "scripts/build_image.sh").read_text()
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert re.search(r"^VERSION=(\S+)$", script, re.M)[1] == version
    assert re.search(r"^IMAGE=\S*?(\w+)$", script, re.M)[1] == "prfaas"


@pytest.mark.parametrize("deployment, role", ROLES)
def test_pods_run_the_image_as_its_user_with_its_ports_and_cache_dir(deployment, role):
    """The manifests and both Containerfiles agree: image name and tag, non-root user, no privilege
    escalation, every container port exposed by the image, the model cache where the image keeps it."""
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    facts = [containerfile_facts(path) for path in CONTAINERFILES]
    assert all(f == facts[0] for f in facts), facts
    image = facts[0]
    rendered = render(deployment, role)
    for workload in rendered.of_kind("StatefulSet") + rendered.of_kind("Deployment"):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == \
            (image["uid"], image["gid"]), name
        main = container(workload)
        assert main["image"].rsplit(":", 1) == ["prfaas", version] or main["image"].endswith(f":{version}"), name
        assert main["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert main["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert set(container_ports(workload).values()) <= image["exposed"], name
        cache = env_of(workload).get("PRFAAS_CACHE_DIR")
        assert cache is None or cache["value"] == image["cache_dir"], name


@pytest.mark.parametrize("deployment", deployments())
def test_router_replicas_may_hold_the_lease_of_role_decisions_and_nothing_more(deployment):
    rendered = render(deployment, "local-cluster")
    config = config_of(rendered)
    assert config.router.role_decisions == "kubernetes-lease"
    pod = rendered.one("Deployment", "router")["spec"]["template"]["spec"]
    binding = rendered.one("RoleBinding", "prfaas-router-lease")
    assert [s["name"] for s in binding["subjects"]] == [pod["serviceAccountName"]]
    rules = rendered.one("Role", binding["roleRef"]["name"])["rules"]
    assert all(r["apiGroups"] == ["coordination.k8s.io"] and r["resources"] == ["leases"] for r in rules)
    named = {verb for r in rules if r.get("resourceNames") == [config.router.lease_name] for verb in r["verbs"]}
    assert named == {"get", "update"}
    assert {verb for r in rules if "resourceNames" not in r for verb in r["verbs"]} == {"create"}
