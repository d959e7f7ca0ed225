"""deploy/k8s: the kustomization renders, every object is valid Kubernetes, and the objects fit together.

Rendering: with a `kustomize` or `kubectl` binary on the PATH, `kustomize build` / `kubectl kustomize` renders the
directory. Without one, the files listed in kustomization.yaml's `resources` are loaded and its simple fields are
applied in Python (`namespace`, `images`, `labels` and `commonLabels`; nothing else is supported, and a
kustomization using any other field fails `test_kustomization_uses_only_supported_fields`). Where a binary is
present, `test_python_render_matches_kustomize` checks that both renderings agree.

Validation: every rendered object against the Kubernetes OpenAPI schemas of K8S_VERSION, strictly (unknown fields are
errors), with `kubernetes-validate`. Then structural facts no schema checks: references between objects, probes,
GPUs, replicas, volumes, images, Prometheus annotations, and that every environment variable is one loraplane reads.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.35.0"  # a recent release among those kubernetes-validate bundles

# Kinds kustomize leaves without a namespace (cluster-scoped); a Namespace itself is renamed to `namespace:`.
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass", "RuntimeClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}
SUPPORTED_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images", "labels", "commonLabels"}
# Variables loraplane does not define but that are documented and meant to be set: Hugging Face's offline switch
# (Dockerfile.worker sets it too).
STANDARD_ENV = {"HF_HUB_OFFLINE"}
# The metrics ports (9100 scheduler, 9101 worker) are being added to the processes alongside these manifests;
# accepted here whether or not common/settings.py has them yet.
METRICS_PORT_ENV = {"LORAPLANE_SCHEDULER_METRICS_PORT": 9100, "LORAPLANE_WORKER_METRICS_PORT": 9101}


# ---- rendering ------------------------------------------------------------------------------------------------------

def load_kustomization(directory: Path = K8S_DIR) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def _template_metadatas(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The metadata of the pod (and job) templates inside a workload, where kustomize puts template labels."""
    spec = obj.get("spec") or {}
    if obj["kind"] == "CronJob":
        job = spec.setdefault("jobTemplate", {})
        return [job.setdefault("metadata", {}), job.setdefault("spec", {}).setdefault("template", {})
                .setdefault("metadata", {})]
    if obj["kind"] in WORKLOADS:
        return [spec.setdefault("template", {}).setdefault("metadata", {})]
    return []


def _selectors(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec") or {}
    if obj["kind"] == "Service":
        return [spec.setdefault("selector", {})]
    if obj["kind"] in WORKLOADS - {"CronJob", "Job"} | {"PodDisruptionBudget"}:
        return [spec.setdefault("selector", {}).setdefault("matchLabels", {})]
    return []


def apply_images(obj: dict[str, Any], images: list[dict[str, Any]]) -> None:
    """kustomize `images:`: a container whose image name (without tag or digest) equals `name` gets `newName`,
    `newTag` or `digest`."""
    for container in _containers(obj):
        image = container["image"]
        name = image.split("@", 1)[0]
        if ":" in name.rsplit("/", 1)[-1]:
            name = name.rsplit(":", 1)[0]
        tag = image[len(name):]
        for rule in images:
            if rule["name"] != name:
                continue
            if "digest" in rule:
                tag = "@" + rule["digest"]
            elif "newTag" in rule:
                tag = ":" + str(rule["newTag"])
            container["image"] = rule.get("newName", name) + tag


def render_python(directory: Path = K8S_DIR) -> list[dict[str, Any]]:
    kustomization = load_kustomization(directory)
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        objects.extend(doc for doc in yaml.safe_load_all((directory / resource).read_text()) if doc)
    namespace = kustomization.get("namespace")
    label_rules = list(kustomization.get("labels", []))
    if kustomization.get("commonLabels"):
        label_rules.append({"pairs": kustomization["commonLabels"], "includeSelectors": True,
                            "includeTemplates": True})
    for obj in objects:
        metadata = obj.setdefault("metadata", {})
        if namespace:
            if obj["kind"] == "Namespace":
                metadata["name"] = namespace
            elif obj["kind"] not in CLUSTER_SCOPED:
                metadata["namespace"] = namespace
        for rule in label_rules:
            pairs = rule.get("pairs", {})
            metadata.setdefault("labels", {}).update(pairs)
            if rule.get("includeSelectors"):
                for selector in _selectors(obj):
                    selector.update(pairs)
            if rule.get("includeTemplates") or rule.get("includeSelectors"):
                for template in _template_metadatas(obj):
                    template.setdefault("labels", {}).update(pairs)
        apply_images(obj, kustomization.get("images", []))
    return objects


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(K8S_DIR)]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(K8S_DIR)]
    return None


def render_binary(command: list[str]) -> list[dict[str, Any]]:
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    command = kustomize_command()
    return render_binary(command) if command else render_python()


# ---- helpers --------------------------------------------------------------------------------------------------------

def _pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if obj["kind"] in WORKLOADS:
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "Pod":
        return obj["spec"]
    return None


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = _pod_spec(obj)
    if spec is None:
        return []
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["metadata"].get("labels", {})
    return obj["spec"]["template"]["metadata"].get("labels", {})


def _pod_annotations(obj: dict[str, Any]) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("annotations", {})


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _component(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] in WORKLOADS
             and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one workload of component {component!r}, found {len(found)}"
    return found[0]


def _only_container(obj: dict[str, Any]) -> dict[str, Any]:
    containers = _containers(obj)
    assert len(containers) == 1, obj["metadata"]["name"]
    return containers[0]


def _env_names(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Every variable the container gets: its `env`, and the keys of the ConfigMaps and Secrets of its `envFrom`."""
    configmaps, secrets = _by_kind(objects, "ConfigMap"), _by_kind(objects, "Secret")
    names: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            names.update(configmaps[source["configMapRef"]["name"]].get("data", {}))
        if "secretRef" in source:
            secret = secrets[source["secretRef"]["name"]]
            names.update({**secret.get("data", {}), **secret.get("stringData", {})})
    names.update({e["name"]: e.get("value") for e in container.get("env", [])})
    return names


def _probe_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"probe port {port!r} is no named port of {container['name']}"
    return int(named[port])


# ---- the kustomization ----------------------------------------------------------------------------------------------

def test_kustomization_uses_only_supported_fields() -> None:
    assert set(load_kustomization()) <= SUPPORTED_FIELDS, "the Python fallback renderer would ignore a field"


def test_every_file_is_listed_in_resources() -> None:
    resources = set(load_kustomization()["resources"])
    manifests = {p.name for p in K8S_DIR.iterdir() if p.suffix in (".yaml", ".yml")} - {"kustomization.yaml"}
    assert manifests == resources
    others = {p.name for p in K8S_DIR.iterdir() if p.suffix not in (".yaml", ".yml")}
    assert others == {"README.md"}, f"unexpected files in deploy/k8s: {others - {'README.md'}}"


def test_python_render_matches_kustomize() -> None:
    command = kustomize_command()
    if command is None:
        pytest.skip("no kustomize or kubectl binary: the Python rendering is the only one")

    def keyed(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(o["kind"], o["metadata"]["name"]): o for o in objs}

    assert keyed(render_python()) == keyed(render_binary(command))


def test_images_can_be_set_through_kustomize() -> None:
    obj = {"kind": "Deployment", "spec": {"template": {"spec": {"containers": [
        {"name": "a", "image": "loraplane/api:latest"}, {"name": "b", "image": "loraplane/worker"},
        {"name": "c", "image": "other/api:1"}]}}}}
    apply_images(obj, [{"name": "loraplane/api", "newName": "reg.example.com:5000/lp/api", "newTag": "1.2.3"},
                       {"name": "loraplane/worker", "digest": "sha256:abc"}])
    assert [c["image"] for c in _containers(obj)] == [
        "reg.example.com:5000/lp/api:1.2.3", "loraplane/worker@sha256:abc", "other/api:1"]


# ---- schema validation ----------------------------------------------------------------------------------------------

def test_every_object_validates_against_the_kubernetes_schemas(objects: list[dict[str, Any]]) -> None:
    assert len(objects) >= 10
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata'].get('name')}: {exc.message} at {list(exc.path)}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type", "missing required"])
def test_the_validation_catches_a_broken_manifest(objects: list[dict[str, Any]], breakage: str) -> None:
    broken = copy.deepcopy(_component(objects, "api"))
    container = _only_container(broken)
    if breakage == "unknown field":
        container["livenesProbe"] = container.pop("livenessProbe")
    elif breakage == "wrong type":
        container["ports"][0]["containerPort"] = "eight thousand"
    else:
        del container["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_everything_is_in_the_kustomization_namespace(objects: list[dict[str, Any]]) -> None:
    namespace = load_kustomization()["namespace"]
    assert set(_by_kind(objects, "Namespace")) == {namespace}
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") == namespace, obj["metadata"]["name"]


# ---- references between objects -------------------------------------------------------------------------------------

def test_env_sources_exist(objects: list[dict[str, Any]]) -> None:
    configmaps, secrets = _by_kind(objects, "ConfigMap"), _by_kind(objects, "Secret")
    for obj in objects:
        for container in _containers(obj):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in configmaps, container["name"]
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, container["name"]
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    key = ref["configMapKeyRef"]
                    assert key["key"] in configmaps[key["name"]].get("data", {}), env["name"]
                if "secretKeyRef" in ref:
                    key = ref["secretKeyRef"]
                    secret = secrets[key["name"]]
                    assert key["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}, env["name"]


def test_every_env_var_is_one_loraplane_reads(objects: list[dict[str, Any]]) -> None:
    known = {field.alias for field in Settings.model_fields.values() if field.alias}
    example = ROOT / "deploy" / "loraplane.env.example"
    documented = {line.split("=", 1)[0] for line in example.read_text().splitlines()
                  if line and not line.startswith("#") and "=" in line}
    allowed = known | documented | STANDARD_ENV | set(METRICS_PORT_ENV)
    for obj in objects:
        for container in _containers(obj):
            unknown = set(_env_names(container, objects)) - allowed
            assert not unknown, f"{obj['metadata']['name']}/{container['name']}: {sorted(unknown)}"
    for name, configmap in _by_kind(objects, "ConfigMap").items():
        assert not set(configmap.get("data", {})) - allowed, name
    for name, secret in _by_kind(objects, "Secret").items():
        assert not set({**secret.get("data", {}), **secret.get("stringData", {})}) - allowed, name


def test_each_process_gets_what_it_needs(objects: list[dict[str, Any]]) -> None:
    api, scheduler, worker = (_env_names(_only_container(_component(objects, c)), objects)
                              for c in ("api", "scheduler", "worker"))
    assert {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ADMIN_TOKEN"} <= set(api)
    assert {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"} <= set(scheduler)
    assert {"REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR"} <= set(worker)
    # deploy/README.md: a worker never reaches the database.
    assert "DATABASE_URL" not in worker and "LORAPLANE_ADMIN_TOKEN" not in worker
    # The API encrypts webhook secrets and the scheduler decrypts them to sign: one key, given to both (and to no
    # worker, which never reads them).
    assert "LORAPLANE_SECRET_KEY" in api and "LORAPLANE_SECRET_KEY" in scheduler
    assert "LORAPLANE_SECRET_KEY" not in worker


def test_secrets_are_placeholders(objects: list[dict[str, Any]]) -> None:
    for name, secret in _by_kind(objects, "Secret").items():
        assert "data" not in secret, f"{name}: write placeholders as stringData"
        for key, value in secret["stringData"].items():
            assert "REPLACE_ME" in value, f"{name}.{key} is not marked as a placeholder"


def test_service_selectors_match_workload_pods(objects: list[dict[str, Any]]) -> None:
    pod_label_sets = [_pod_labels(o) for o in objects if o["kind"] in WORKLOADS]
    for name, service in _by_kind(objects, "Service").items():
        selector = service["spec"]["selector"]
        assert selector, name
        matches = [labels for labels in pod_label_sets if selector.items() <= labels.items()]
        assert matches, f"Service {name} selects no workload's pods"
    for obj in objects:
        if obj["kind"] in WORKLOADS - {"CronJob", "Job"}:
            assert obj["spec"]["selector"]["matchLabels"].items() <= _pod_labels(obj).items()
    for name, pdb in _by_kind(objects, "PodDisruptionBudget").items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= labels.items() for labels in pod_label_sets), name


def test_service_ports_target_container_ports(objects: list[dict[str, Any]]) -> None:
    for name, service in _by_kind(objects, "Service").items():
        selector = service["spec"]["selector"]
        workloads = [o for o in objects if o["kind"] in WORKLOADS and selector.items() <= _pod_labels(o).items()]
        ports = {(p.get("name"), p["containerPort"]) for w in workloads for c in _containers(w) for p in c["ports"]}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in pair for pair in ports), f"Service {name} port {port} targets no container port"


def test_volumes_refer_to_existing_claims(objects: list[dict[str, Any]]) -> None:
    claims = _by_kind(objects, "PersistentVolumeClaim")
    for obj in objects:
        spec = _pod_spec(obj)
        if spec is None:
            continue
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, volume
        for container in _containers(obj):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{obj['metadata']['name']}: mount {mount['name']} has no volume"


def _mounts(obj: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """mountPath -> (claim name or volume name, read-only) of the workload's only container."""
    volumes = {v["name"]: v for v in _pod_spec(obj)["volumes"]}
    out = {}
    for mount in _only_container(obj).get("volumeMounts", []):
        volume = volumes[mount["name"]]
        claim = volume.get("persistentVolumeClaim", {}).get("claimName", mount["name"])
        out[mount["mountPath"]] = (claim, bool(mount.get("readOnly")))
    return out


def test_models_read_only_and_artifacts_shared(objects: list[dict[str, Any]]) -> None:
    artifact_dir = _by_kind(objects, "ConfigMap")["loraplane-config"]["data"]["LORAPLANE_ARTIFACT_DIR"]
    claims = _by_kind(objects, "PersistentVolumeClaim")
    assert claims["loraplane-artifacts"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for component in ("api", "worker"):
        mounts = _mounts(_component(objects, component))
        assert mounts["/srv/models"] == ("loraplane-models", True), component
        assert mounts[artifact_dir] == ("loraplane-artifacts", False), component


# ---- the processes --------------------------------------------------------------------------------------------------

def test_api_probes(objects: list[dict[str, Any]]) -> None:
    container = _only_container(_component(objects, "api"))
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    api_port = int(container["command"][container["command"].index("--port") + 1])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in container:
            assert _probe_port(container, container[probe]["httpGet"]["port"]) == api_port, probe
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_scheduler_runs_two_replicas_with_a_probe(objects: list[dict[str, Any]]) -> None:
    scheduler = _component(objects, "scheduler")
    assert scheduler["kind"] == "Deployment" and scheduler["spec"]["replicas"] == 2
    container = _only_container(scheduler)
    assert container["command"] == ["loraplane", "scheduler"]
    probe = container["livenessProbe"]
    assert "exec" in probe or "tcpSocket" in probe or "httpGet" in probe


def test_workers_take_one_gpu_each(objects: list[dict[str, Any]]) -> None:
    worker = _component(objects, "worker")
    container = _only_container(worker)
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert str(container["resources"]["requests"].get("nvidia.com/gpu", "1")) == "1"
    # The pod sees its one GPU as device 0.
    assert container["command"][:2] == ["loraplane", "worker"] and container["command"][-2:] == ["--gpu", "0"]
    tolerations = _pod_spec(worker).get("tolerations", [])
    assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations)


def test_images(objects: list[dict[str, Any]]) -> None:
    assert {image["name"] for image in load_kustomization()["images"]} == {"loraplane/api", "loraplane/worker"}
    for component in ("api", "scheduler", "migrate"):
        assert _only_container(_component(objects, component))["image"].startswith("loraplane/api:")
    assert _only_container(_component(objects, "worker"))["image"].startswith("loraplane/worker:")


def test_prometheus_annotations(objects: list[dict[str, Any]]) -> None:
    expected = {"api": 8000, "scheduler": METRICS_PORT_ENV["LORAPLANE_SCHEDULER_METRICS_PORT"],
                "worker": METRICS_PORT_ENV["LORAPLANE_WORKER_METRICS_PORT"]}
    for component, port in expected.items():
        workload = _component(objects, component)
        annotations = _pod_annotations(workload)
        assert annotations["prometheus.io/scrape"] == "true", component
        assert annotations["prometheus.io/port"] == str(port), component
        assert annotations["prometheus.io/path"] == "/metrics", component
        container = _only_container(workload)
        assert port in {p["containerPort"] for p in container["ports"]}, component
        env = _env_names(container, objects)
        for name, metrics_port in METRICS_PORT_ENV.items():
            if name in env:
                assert int(env[name]) == metrics_port == port, component


def test_the_worker_pod_outlives_its_drain(objects: list[dict[str, Any]]) -> None:
    """SIGTERM drains a worker within LORAPLANE_WORKER_DRAIN_S (worker/drain.py): its pod's grace period must not
    SIGKILL it first, and docker compose's neither (its default is 10 s)."""
    drain_s = Settings.model_fields["worker_drain_s"].default
    grace_s = _pod_spec(_component(objects, "worker"))["terminationGracePeriodSeconds"]
    assert drain_s < grace_s <= 30  # within Kubernetes' default: a pod's stop is not held up by more
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["worker"]["stop_grace_period"] == f"{grace_s}s"
