"""The Helm chart (k8s/pdserve) rendered and linted by real Helm, validated against Kubernetes schemas.

Helm is helm-python-sdk: Helm's own Go library behind a C ABI, so no helm binary is downloaded.
Every rendered object of every scenario is validated strictly against the Kubernetes 1.30 schemas
that kubernetes-validate ships, except the custom resources in CRD_KINDS (no schema there). The
containers' args are parsed by the project's own CLI parser, so the chart deploys only commands
and flags `pdserve` accepts, and the ports, probes, drain times and Secrets line up with them.
"""

from __future__ import annotations

import inspect
import json
import re
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from aiohttp import web
from helm_python import _native

from engine import env
from services.cli import build_parser
from services.common import grpc_utils
from services.router.server import RouterServerConfig

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "k8s" / "pdserve"
RELEASE, NAMESPACE = "demo", "ml"
FULLNAME = f"{RELEASE}-pdserve"
KUBE_VERSION = "1.30.0"
CRD_APIS = {"ServiceMonitor": "monitoring.coreos.com/v1", "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1"}
CRD_KINDS = frozenset(CRD_APIS)  # custom resources: kubernetes-validate has no schema for them
WITH_CRDS = tuple(CRD_APIS.values())
ROLES = ("prefill", "decode", "colocated")
WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
# Values for the $(VAR) references Kubernetes expands in args, as the kubelet would.
EXPANSIONS = {
    "POD_IP": "10.1.2.3",
    "POD_INDEX": "3",
    "LWS_LEADER_ADDRESS": "demo-pdserve-decode-0.demo-pdserve-decode.ml",
    "PDSERVE_REGISTRY_URL": "redis://from-secret:6379/0",
    "REDIS_PASSWORD": "redis-pw",
}
INJECTED_BY_LWS = {"LWS_LEADER_ADDRESS"}  # set in the pod by the LeaderWorkerSet webhook
PVC = {"source": "pvc", "pvc": {"claimName": "deepseek-weights"}, "name": "DeepSeek-V3"}

SCENARIOS: dict[str, dict] = {
    "default": {},
    "2-prefill-4-decode": {"workers": {"prefill": {"replicas": 2}, "decode": {"replicas": 4}}},
    "decode-dep4": {
        "model": PVC,
        "workers": {
            "prefill": {"replicas": 2, "gpus": 1},
            "decode": {"replicas": 2, "dp": 4, "ep": 4, "gpus": 1, "extraArgs": ["--num-kv-blocks", "8192"]},
        },
    },
    "decode-dep4-lws": {
        "model": PVC,
        "leaderWorkerSet": {"enabled": True},
        "workers": {"decode": {"replicas": 2, "dp": 4, "ep": 4, "gpus": 1}},
    },
    "auth": {"auth": {"enabled": True}},
    "auth-existing-secret": {"auth": {"enabled": True, "existingSecret": "pdserve-token", "secretKey": "t"}},
    "no-auth": {"auth": {"enabled": False}},
    "network-policy": {
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ],
        },
        "workers": {"colocated": {"enabled": True}},
    },
    "network-policy-grpc-kv": {
        "networkPolicy": {"enabled": True},
        "kvTransfer": {"transport": "grpc", "checksum": False, "ucx": {}},
    },
    "nixl-ucx": {
        "kvTransfer": {"transport": "nixl", "checksum": True, "ucx": {"UCX_TLS": "rc,tcp,cuda_copy"}}
    },
    "no-kv-prefault": {"kvCache": {"prefault": False}},
    "redis-existing-secret": {"redis": {"auth": {"existingSecret": "redis-pw", "secretKey": "pw"}}},
    "redis-no-auth": {"redis": {"auth": {"enabled": False}}},
    "monitoring": {"monitoring": {"enabled": True}},
    "external-redis": {"redis": {"enabled": False, "externalUrl": "redis://redis.infra:6379/2"}},
    "external-redis-secret": {"redis": {"enabled": False, "externalUrlSecret": {"name": "redis-url"}}},
    "external-rediss": {"redis": {"enabled": False, "externalUrl": "rediss://:pw@redis.infra:6380/0"}},
    "api-keys": {"router": {"apiKeys": {"existingSecret": "pdserve-api-keys", "secretKey": "keys.txt"}}},
    "hostpath-hpa-colocated": {
        "model": {"source": "hostPath", "hostPath": {"path": "/data/models"}, "servedModelName": "tiny"},
        "router": {"autoscaling": {"enabled": True}, "extraArgs": ["--max-in-flight", "512"]},
        "workers": {"colocated": {"enabled": True}, "prefill": {"enabled": False}},
    },
}

# The worked example of k8s/README.md, so the documentation renders and validates too.
README_EXAMPLE = re.search(
    r"```yaml\n(# values-dep\.yaml\n.*?)```", (REPO / "k8s" / "README.md").read_text(), re.S
)
SCENARIOS["readme-dep-example"] = yaml.safe_load(README_EXAMPLE[1])

BAD_VALUES: dict[str, tuple[dict, str]] = {
    "negative-replicas": ({"workers": {"decode": {"replicas": -1}}}, "minimum"),
    "negative-router-replicas": ({"router": {"replicas": -2}}, "minimum"),
    "unknown-role": ({"workers": {"verifier": {"enabled": True}}}, "verifier"),
    "missing-model-source": ({"model": {"source": None}}, "source"),
    "unknown-model-source": ({"model": {"source": "s3"}}, "source"),
    "pvc-without-claim": ({"model": {"source": "pvc"}}, "claimName"),
    "hostpath-without-path": ({"model": {"source": "hostPath"}}, "path"),
    "latest-tag": ({"image": {"tag": "latest"}}, "tag"),
    "latest-tag-per-role": ({"workers": {"decode": {"image": {"tag": "latest"}}}}, "tag"),
    "external-redis-without-url": ({"redis": {"enabled": False}}, "redis"),
    "gpu-in-requests": ({"workers": {"decode": {"resources": {"requests": {"nvidia.com/gpu": 1}}}}}, "gpu"),
    "ep-zero": ({"workers": {"decode": {"ep": 0}}}, "minimum"),
    "dp-not-ep": ({"workers": {"decode": {"dp": 2, "ep": 4}}}, "must equal ep"),
    "dp-without-ep": ({"workers": {"decode": {"dp": 2}}}, "without ep"),
    "bad-port": ({"router": {"grpcPort": 70000}}, "maximum"),
    "typo": ({"routr": {"replicas": 1}}, "routr"),
    "redis-password-not-url-safe": ({"redis": {"auth": {"password": "p@ss/word"}}}, "password"),
    "external-http-redis": ({"redis": {"enabled": False, "externalUrl": "http://redis:6379"}}, "externalUrl"),
    "unknown-kv-transport": ({"kvTransfer": {"transport": "rdma"}}, "transport"),
    "non-ucx-env-in-ucx": ({"kvTransfer": {"ucx": {"LD_PRELOAD": "x.so"}}}, "LD_PRELOAD"),
    "kv-prefault-not-a-boolean": ({"kvCache": {"prefault": "yes"}}, "prefault"),
}


@cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


@cache
def _render(values_json: str, api_versions: tuple[str, ...]) -> tuple[dict, ...]:
    # Chart.render() does not expose `helm template`'s --kube-version / --api-versions; the
    # native call it wraps takes both (helm-python-sdk is pinned exactly in pyproject.toml).
    opts = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": "v" + KUBE_VERSION}
    opts["api_versions"] = list(api_versions)
    raw = _native.call_string("helm_render", chart()._raw(), values_json, json.dumps(opts))
    docs = []
    for name, text in sorted(json.loads(raw).items()):
        if name.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return tuple(docs)


def render(values: dict, api_versions: tuple[str, ...] = WITH_CRDS) -> list[dict]:
    """The chart's objects for these values, on a 1.30 cluster that has the given API groups."""
    return list(_render(json.dumps(values, sort_keys=True), tuple(api_versions)))


def scenario(name: str) -> list[dict]:
    return render(SCENARIOS[name])


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_template(workload: dict) -> dict:
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return workload["spec"]["template"]


def pods(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod template) for every workload."""
    return [(w, pod_template(w)) for w in docs if w["kind"] in WORKLOADS]


def pdserve_containers(docs: list[dict]):
    """(workload, pod template, container) for every container running `pdserve`."""
    for workload, tpl in pods(docs):
        for c in tpl["spec"]["containers"]:
            if c.get("command") == ["pdserve"]:
                yield workload, tpl, c


def expand(args: list[str], container: dict) -> list[str]:
    """Kubernetes' $(VAR) expansion; every variable must be defined in the container's env."""
    defined = {e["name"] for e in container.get("env", [])} | INJECTED_BY_LWS

    def one(m: re.Match) -> str:
        assert m.group(1) in defined, f"{container['name']}: $({m.group(1)}) is not in its env"
        return EXPANSIONS[m.group(1)]

    return [re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)", one, a) for a in args]


def parse(container: dict):
    """The container's args as `pdserve` parses them (the image's command is `pdserve`)."""
    argv = expand(container["args"], container)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"pdserve rejects the chart's args {argv}") from e
    return args


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def ports_of(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def registry_url(values: dict) -> str:
    redis = values.get("redis", {})
    if redis.get("enabled", True) and redis.get("auth", {}).get("enabled", True):
        return f"redis://:{EXPANSIONS['REDIS_PASSWORD']}@{FULLNAME}-redis:6379/0"
    if redis.get("enabled", True):
        return f"redis://{FULLNAME}-redis:6379/0"
    return redis.get("externalUrl") or EXPANSIONS["PDSERVE_REGISTRY_URL"]


def prestop_sleep(container: dict) -> int:
    script = container["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert script.endswith("kill -TERM 1"), f"{container['name']}: preStop must start the drain: {script}"
    m = re.match(r"sleep (\d+); ", script)
    return int(m.group(1)) if m else 0


# --- Helm: lint, render, values schema -----------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in SCENARIOS if "lws" not in n])  # lint cannot declare the LWS CRD
def test_lint_passes(name):
    report = helm.lint(CHART, SCENARIOS[name], strict=True, kube_version="v" + KUBE_VERSION)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_manifest_validates_against_kubernetes_schemas(name):
    docs = scenario(name)
    assert docs
    seen = set()
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        assert doc["metadata"]["name"].startswith(FULLNAME)
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == CRD_APIS[doc["kind"]]
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_are_refused(case):
    values, fragment = BAD_VALUES[case]
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError), match=re.escape(fragment)):
        chart().render(values, name=RELEASE)


def test_schema_accepts_the_defaults_and_lint_reports_bad_values():
    chart().validate_schema(chart().values)
    with pytest.raises(helm.HelmValuesError, match="replicas"):
        chart().validate_schema(chart().merge_values({"workers": {"prefill": {"replicas": -1}}}))
    report = helm.lint(CHART, {"workers": {"decode": {"replicas": -1}}}, kube_version="v" + KUBE_VERSION)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


def test_public_render_matches_and_gates_the_servicemonitor_on_its_crd():
    """Helm without the Prometheus Operator's API (plain Chart.render) renders no ServiceMonitor."""
    plain = [
        doc
        for name, text in sorted(chart().render({"monitoring": {"enabled": True}}, name=RELEASE).items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    assert by_kind(plain, "ServiceMonitor") == []
    assert len(plain) == len(scenario("monitoring")) - 1
    assert by_kind(render({"workers": {"decode": {"dp": 2, "ep": 2}}}), "StatefulSet")
    with pytest.raises(helm.HelmRenderError, match="LeaderWorkerSet CRD"):
        render(SCENARIOS["decode-dep4-lws"], api_versions=())


# --- The objects --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_commands_and_ports_are_what_pdserve_accepts(name):
    values, docs = SCENARIOS[name], scenario(name)
    model = values.get("model", {})
    model_path = "/models/" + model.get("name", "pdserve-tiny")
    roles_seen = set()
    for workload, tpl, c in pdserve_containers(docs):
        args, ports = parse(c), ports_of(c)
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert args.model == model_path and "/models" in mounts
        assert args.served_model_name == model.get("servedModelName")
        assert args.registry == registry_url(values)
        if args.command == "router":
            assert component == "router" and args.workers is None
            assert args.host == "0.0.0.0" and not args.no_http
            assert ports == {"grpc": args.grpc_port, "http": args.http_port}
        else:
            assert args.command == "worker" and args.role == component
            roles_seen.add(args.role)
            # The worker registers --host in Redis: it binds the pod IP, the address peers reach.
            assert args.host == EXPANSIONS["POD_IP"]
            assert env_of(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert args.port == ports["grpc"] and args.metrics_port == ports["metrics"]
            assert args.grace_s == values.get("drain", {}).get("graceSeconds", 30)
            w = values.get("workers", {}).get(component, {})
            ep = w.get("ep", 1)
            if ep == 1:
                assert workload["kind"] == "Deployment" and args.dp == 1 and args.ep is None
                assert workload["spec"]["replicas"] == w.get("replicas", 1)
            else:
                check_ep_group(docs, workload, c, args, ep)
        for init in tpl["spec"].get("initContainers", []):
            if init["command"][0] == "pdserve":  # the default: build the tiny model into the emptyDir
                made = build_parser().parse_args(init["command"][1:])
                assert made.command == "make-model" and made.out == model_path
    workers = values.get("workers", {})
    enabled = {r for r in ROLES if workers.get(r, {}).get("enabled", r != "colocated")}
    assert roles_seen == enabled


def check_ep_group(docs, workload, c, args, ep):
    """One pod per rank: `--dp 1 --ep N --dp-rank-offset <ordinal>`, rank 0 found by DNS."""
    assert args.dp == 1 and args.ep == ep
    assert args.dp_rank_offset == int(EXPANSIONS["POD_INDEX"])
    assert args.dist_master_port == ports_of(c)["dist"]
    index_ref = env_of(c)["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    if workload["kind"] == "LeaderWorkerSet":
        assert workload["spec"]["leaderWorkerTemplate"]["size"] == ep
        assert index_ref == "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
        assert args.dist_master_addr == EXPANSIONS["LWS_LEADER_ADDRESS"]
        assert "$(LWS_LEADER_ADDRESS)" in c["args"]
        return
    spec = workload["spec"]
    assert workload["kind"] == "StatefulSet" and spec["replicas"] == ep
    assert spec["podManagementPolicy"] == "Parallel"  # rank 0 waits for the others: start all at once
    assert index_ref == "metadata.labels['apps.kubernetes.io/pod-index']"
    svc = named(docs, "Service", spec["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert args.dist_master_addr == f"{workload['metadata']['name']}-0.{svc['metadata']['name']}"
    labels = pod_template(workload)["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert "dist" in {p["name"] for p in svc["spec"]["ports"]}


def test_extra_args_reach_the_cli():
    (_, _, c), *_ = pdserve_containers(scenario("hostpath-hpa-colocated"))
    assert parse(c).command == "router" and parse(c).max_in_flight == 512
    docs = scenario("decode-dep4")
    for workload, _, c in pdserve_containers(docs):
        args = parse(c)
        if args.command == "worker":
            assert args.num_kv_blocks == (8192 if workload["kind"] == "StatefulSet" else None)


def test_readme_example_is_a_dp8_decode_group_and_a_dp4_prefill_group():
    docs = scenario("readme-dep-example")
    groups = {s["metadata"]["name"]: s["spec"]["replicas"] for s in by_kind(docs, "StatefulSet")}
    assert groups == {f"{FULLNAME}-prefill-0": 4, f"{FULLNAME}-decode-0": 8}
    images = {c["name"]: c["image"] for _, _, c in pdserve_containers(docs)}
    assert images == {
        "router": "registry.example.com/pdserve:0.1.0",
        "worker": "registry.example.com/pdserve:0.1.0-cuda",
    }
    assert by_kind(docs, "ServiceMonitor") and by_kind(docs, "Secret")


def test_replica_counts_and_ep_groups():
    docs = scenario("2-prefill-4-decode")
    assert named(docs, "Deployment", f"{FULLNAME}-prefill")["spec"]["replicas"] == 2
    assert named(docs, "Deployment", f"{FULLNAME}-decode")["spec"]["replicas"] == 4
    docs = scenario("decode-dep4")
    groups = [s for s in by_kind(docs, "StatefulSet")]
    assert [s["metadata"]["name"] for s in groups] == [f"{FULLNAME}-decode-0", f"{FULLNAME}-decode-1"]
    assert {s["spec"]["replicas"] for s in groups} == {4}
    assert named(docs, "Deployment", f"{FULLNAME}-prefill")["spec"]["replicas"] == 2
    (lws,) = by_kind(scenario("decode-dep4-lws"), "LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    hpa = by_kind(scenario("hostpath-hpa-colocated"), "HorizontalPodAutoscaler")
    assert [h["spec"]["scaleTargetRef"]["name"] for h in hpa] == [f"{FULLNAME}-router"]
    assert (
        "replicas"
        not in named(scenario("hostpath-hpa-colocated"), "Deployment", f"{FULLNAME}-router")["spec"]
    )


@pytest.mark.parametrize("name", SCENARIOS)
def test_grpc_health_probes_on_numeric_ports(name):
    for _, _, c in pdserve_containers(scenario(name)):
        args = parse(c)
        port = args.grpc_port if args.command == "router" else args.port
        services = {"startupProbe": grpc_utils.LIVENESS, "readinessProbe": grpc_utils.READINESS}
        services["livenessProbe"] = grpc_utils.LIVENESS
        for probe, service in services.items():
            grpc = c[probe]["grpc"]
            assert grpc == {"port": port, "service": service}, f"{c['name']} {probe}"
            assert isinstance(grpc["port"], int)


@pytest.mark.parametrize("name", SCENARIOS)
def test_termination_grace_outlasts_prestop_and_drain(name):
    router_drain = RouterServerConfig.__dataclass_fields__["grace_s"].default
    router_drain += inspect.signature(web.TCPSite).parameters["shutdown_timeout"].default
    for _, tpl, c in pdserve_containers(scenario(name)):
        args = parse(c)
        drain = router_drain if args.command == "router" else args.grace_s
        grace = tpl["spec"]["terminationGracePeriodSeconds"]
        assert grace > prestop_sleep(c) + drain, f"{c['name']}: {grace} s <= preStop + {drain} s drain"


@pytest.mark.parametrize("name", SCENARIOS)
def test_one_pdb_per_role(name):
    values, docs = SCENARIOS[name], scenario(name)
    workers = values.get("workers", {})
    roles = ["router"] + [r for r in ROLES if workers.get(r, {}).get("enabled", r != "colocated")]
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pdbs) == sorted(roles)
    for pdb in pdbs:
        selector = pdb["spec"]["selector"]["matchLabels"]
        covered = {
            tpl["metadata"]["labels"]["app.kubernetes.io/component"]
            for _, tpl in pods(docs)
            if selector.items() <= tpl["metadata"]["labels"].items()
        }
        assert covered == {pdb["metadata"]["labels"]["app.kubernetes.io/component"]}


@pytest.mark.parametrize("name", SCENARIOS)
def test_gpus_only_in_limits(name):
    values, docs = SCENARIOS[name], scenario(name)
    for workload, tpl in pods(docs):
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        gpus = values.get("workers", {}).get(component, {}).get("gpus", 0)
        for c in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", []):
            res = c.get("resources", {})
            assert "nvidia.com/gpu" not in res.get("requests", {})
            assert "cpu" in res.get("limits", {}), f"{c['name']}: thread counts follow limits.cpu"
            expected = gpus if c["name"] == "worker" and gpus else None
            assert res.get("limits", {}).get("nvidia.com/gpu") == expected


@pytest.mark.parametrize("name", SCENARIOS)
def test_security_context_and_pinned_images(name):
    for _, tpl in pods(scenario(name)):
        spec = tpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            image = c["image"].split("@")[0]
            assert ":" in image.rsplit("/", 1)[-1], f"{c['image']}: no tag"
            assert not image.endswith(":latest")


@pytest.mark.parametrize("name", SCENARIOS)
def test_internal_token_from_a_secret_when_auth_is_on(name, monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "s3cret")
    assert env.internal_token() == "s3cret"  # the variable pdserve reads
    values, docs = SCENARIOS[name], scenario(name)
    auth = values.get("auth", {})
    enabled = auth.get("enabled", True)  # on by default
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    secrets.pop(f"{FULLNAME}-redis", None)  # the Redis password's
    refs = []
    for _, _, c in pdserve_containers(docs):
        token = env_of(c).get("PDSERVE_INTERNAL_TOKEN")
        if not enabled:
            assert token is None
            continue
        ref = token["valueFrom"]["secretKeyRef"]
        refs.append((ref["name"], ref["key"]))
    if not enabled:
        assert secrets == {}
        return
    assert len(refs) == len(list(pdserve_containers(docs))) and len(set(refs)) == 1
    ((name_, key),) = set(refs)
    assert key == auth.get("secretKey", "token")
    if auth.get("existingSecret"):
        assert name_ == auth["existingSecret"] and secrets == {}
    else:
        assert len(secrets[name_]["data"][key]) > 0


@pytest.mark.parametrize("name", SCENARIOS)
def test_api_keys_from_a_secret_mounted_as_the_routers_key_file(name):
    """router.apiKeys.existingSecret: the Secret's key is a file the router reads with
    --api-key-file (keys stay out of the pod spec); unset, the router takes none (an open API)."""
    keys = SCENARIOS[name].get("router", {}).get("apiKeys", {})
    for _, tpl, c in pdserve_containers(scenario(name)):
        args = parse(c)
        volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        if args.command != "router" or not keys:
            assert getattr(args, "api_key_file", None) is None and not getattr(args, "api_key", None)
            assert "api-keys" not in volumes and "api-keys" not in mounts
            continue
        secret = volumes["api-keys"]["secret"]
        assert secret["secretName"] == keys["existingSecret"]
        [item] = secret["items"]
        assert item["key"] == keys["secretKey"]
        assert mounts["api-keys"]["readOnly"] is True
        assert args.api_key_file == f"{mounts['api-keys']['mountPath']}/{item['path']}"


def test_notes_show_the_api_key_in_use_or_warn_there_is_none():
    text = notes(SCENARIOS["api-keys"])
    assert "Authorization: Bearer $KEY" in text and "Secret pdserve-api-keys, key keys.txt" in text
    assert "takes no API key" not in text
    assert "takes no API key" in notes(SCENARIOS["default"])


def test_external_redis():
    for name in ("external-redis", "external-redis-secret"):
        docs = scenario(name)
        assert [d for d in docs if d["metadata"]["name"].endswith("-redis")] == []
        for _, _, c in pdserve_containers(docs):
            assert parse(c).registry == registry_url(SCENARIOS[name])
    (_, _, c), *_ = pdserve_containers(scenario("external-redis-secret"))
    assert env_of(c)["PDSERVE_REGISTRY_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-url",
        "key": "url",
    }
    docs = scenario("default")
    redis = named(docs, "Service", f"{FULLNAME}-redis")
    assert redis["spec"]["ports"][0]["port"] == 6379


def test_servicemonitor_scrapes_router_and_worker_metrics():
    assert by_kind(scenario("default"), "ServiceMonitor") == []
    docs = scenario("monitoring")
    (sm,) = by_kind(docs, "ServiceMonitor")
    selector = sm["spec"]["selector"]["matchLabels"]
    services = [s for s in by_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()]
    port_names = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= port_names
    assert {e["path"] for e in sm["spec"]["endpoints"]} == {"/metrics"}
    router = named(docs, "Service", f"{FULLNAME}-router")
    assert router in services and {"grpc", "http"} <= {p["name"] for p in router["spec"]["ports"]}
    for role in ("prefill", "decode"):
        assert named(docs, "Service", f"{FULLNAME}-{role}") in services


def test_dockerfile_runs_pdserve_as_the_charts_user_on_its_ports():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["pdserve"\]', text, re.M)
    assert re.search(r"^ARG VARIANT=cpu", text, re.M) and "cuda" in text
    (user,) = re.findall(r"^USER (\d+)", text, re.M)
    assert int(user) == chart().values["podSecurityContext"]["runAsUser"]
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    values = chart().values
    ports = {values["router"]["grpcPort"], values["router"]["httpPort"]}
    ports |= {values["workers"][r][k] for r in ROLES for k in ("port", "metricsPort", "distMasterPort")}
    assert ports <= exposed
    assert (
        chart().metadata["appVersion"]
        == re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]
    )


# --- Secure by default ----------------------------------------------------------------------------


def notes(values: dict) -> str:
    raw = _native.call_string(
        "helm_render",
        chart()._raw(),
        json.dumps(values),
        json.dumps({"name": RELEASE, "namespace": NAMESPACE}),
    )
    (text,) = [t for name, t in json.loads(raw).items() if name.endswith("NOTES.txt")]
    return text


def redis_container(docs: list[dict]) -> dict:
    (c,) = named(docs, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    return c


def test_default_render_protects_internal_rpcs_and_redis():
    docs = scenario("default")
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    assert secrets[f"{FULLNAME}-internal-token"]["data"]["token"]
    assert len(secrets[f"{FULLNAME}-redis"]["data"]["password"]) > 0
    redis = redis_container(docs)
    password_ref = {"name": f"{FULLNAME}-redis", "key": "password"}
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == password_ref
    assert expand(redis["args"], redis)[-2:] == ["--requirepass", EXPANSIONS["REDIS_PASSWORD"]]
    assert "--protected-mode" not in redis["args"]
    containers = list(pdserve_containers(docs))
    assert {c["name"] for _, _, c in containers} == {"router", "worker"}
    for _, _, c in containers:
        env_ = env_of(c)
        assert (
            env_["PDSERVE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
            == f"{FULLNAME}-internal-token"
        )
        assert env_["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == password_ref
        args = parse(c)
        assert urlsplit(args.registry).password == EXPANSIONS["REDIS_PASSWORD"]
        assert args.insecure_internal is False and "--insecure-internal" not in c["args"]
    assert "WARNING" not in notes({})


def test_redis_password_from_an_existing_secret_or_off():
    docs = scenario("redis-existing-secret")
    assert f"{FULLNAME}-redis" not in {s["metadata"]["name"] for s in by_kind(docs, "Secret")}
    for c in [redis_container(docs)] + [c for _, _, c in pdserve_containers(docs)]:
        assert env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-pw", "key": "pw"}
    docs = scenario("redis-no-auth")
    assert "--requirepass" not in redis_container(docs)["args"]
    for _, _, c in pdserve_containers(docs):
        assert "REDIS_PASSWORD" not in env_of(c) and urlsplit(parse(c).registry).password is None
    assert "redis.auth.enabled=false" in notes(SCENARIOS["redis-no-auth"])
    for _, _, c in pdserve_containers(scenario("external-rediss")):
        assert parse(c).registry == "rediss://:pw@redis.infra:6380/0"


def test_auth_disabled_passes_insecure_internal_and_the_notes_warn():
    docs = scenario("no-auth")
    for _, _, c in pdserve_containers(docs):
        assert "PDSERVE_INTERNAL_TOKEN" not in env_of(c)
        assert parse(c).insecure_internal is True
    assert "WARNING: auth.enabled=false" in notes(SCENARIOS["no-auth"])


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_pdserve_pod_passes_the_exposure_check(name, monkeypatch):
    """What `pdserve worker/router` checks at start: a pod-IP or 0.0.0.0 --host needs the token
    (or mutual TLS) unless the chart says --insecure-internal, which it does only without auth."""
    from services.common.security import Security, check_exposure

    enabled = SCENARIOS[name].get("auth", {}).get("enabled", True)
    for _, _, c in pdserve_containers(scenario(name)):
        args = parse(c)
        token = "t" if "PDSERVE_INTERNAL_TOKEN" in env_of(c) else None
        assert (token is not None) == enabled and args.insecure_internal == (not enabled)
        check_exposure(args.host, Security(token=token), args.insecure_internal)


def _selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_network_policies_admit_only_the_release_to_workers_and_redis():
    assert by_kind(scenario("default"), "NetworkPolicy") == []
    docs = scenario("network-policy")
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    assert set(policies) == {f"{FULLNAME}-{n}" for n in ("workers", "redis", "router")}
    labels = {
        tpl["metadata"]["labels"]["app.kubernetes.io/component"]: (tpl["metadata"]["labels"], tpl)
        for _, tpl in pods(docs)
    }
    assert set(labels) == {"router", "prefill", "decode", "colocated", "redis"}
    other_release = {**labels["router"][0], "app.kubernetes.io/instance": "other"}

    def covered(spec):
        return {comp for comp, (lab, _) in labels.items() if _selects(spec["podSelector"], lab)}

    workers, redis, router = (policies[f"{FULLNAME}-{n}"] for n in ("workers", "redis", "router"))
    assert covered(workers) == {"prefill", "decode", "colocated"}
    assert covered(redis) == {"redis"} and covered(router) == {"router"}
    for spec in (workers, redis, router):
        assert spec["policyTypes"] == ["Ingress"]
    internal, metrics, data_plane = workers["ingress"]
    for rule in (internal, redis["ingress"][0]):
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # this namespace only
        assert {c for c, (lab, _) in labels.items() if _selects(peer["podSelector"], lab)} == set(labels)
        assert not _selects(peer["podSelector"], other_release)
    assert {p["port"] for p in internal["ports"]} == {"grpc", "dist"}
    assert {p["port"] for p in redis["ingress"][0]["ports"]} == {"redis"}
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics["from"] == SCENARIOS["network-policy"]["networkPolicy"]["metricsFrom"]
    ((rule),) = router["ingress"]
    assert "from" not in rule and {p["port"] for p in rule["ports"]} == {"grpc", "http"}
    # The named ports exist on the pods they admit to.
    for comp in ("prefill", "decode", "colocated"):
        (c,) = labels[comp][1]["spec"]["containers"]
        assert {"grpc", "metrics"} <= set(ports_of(c))
    assert "redis" in ports_of(labels["redis"][1]["spec"]["containers"][0])
    assert {"grpc", "http"} <= set(ports_of(labels["router"][1]["spec"]["containers"][0]))
    # NIXL (kvTransfer.transport auto): workers take UCX's connections from workers only, any port.
    ((peer),) = data_plane["from"]
    assert "ports" not in data_plane and set(peer) == {"podSelector"}
    assert {c for c, (lab, _) in labels.items() if _selects(peer["podSelector"], lab)} == {
        "prefill",
        "decode",
        "colocated",
    }
    # The gRPC chunk stream only: no such rule.
    grpc_only = {
        p["metadata"]["name"]: p["spec"] for p in by_kind(scenario("network-policy-grpc-kv"), "NetworkPolicy")
    }
    assert len(grpc_only[f"{FULLNAME}-workers"]["ingress"]) == 2


@pytest.mark.parametrize("name", ["default", "network-policy-grpc-kv", "nixl-ucx"])
def test_kv_transport_checksum_and_ucx_settings_reach_every_worker(name):
    kv = {"transport": "auto", "checksum": True, "ucx": {}} | SCENARIOS[name].get("kvTransfer", {})
    workers = 0
    for _, tpl, c in pdserve_containers(scenario(name)):
        args = parse(c)
        if args.command != "worker":
            continue
        workers += 1
        assert (args.kv_transport, args.kv_checksum) == (kv["transport"], kv["checksum"])
        env = env_of(c)
        assert {k: env[k]["value"] for k in env if k.startswith("UCX_")} == kv["ucx"]
        # /dev/shm: a memory-backed emptyDir (NCCL, and UCX's shared memory inside the pod)
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        (shm,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
    assert workers >= 2


@pytest.mark.parametrize("name, prefault", [("default", True), ("no-kv-prefault", False)])
def test_kv_cache_prefault_reaches_every_worker(name, prefault):
    workers = [parse(c) for _, _, c in pdserve_containers(scenario(name))]
    workers = [args for args in workers if args.command == "worker"]
    assert len(workers) >= 2 and all(args.kv_prefault is prefault for args in workers)
