"""The Kubernetes and systemd files under deploy/ keep the fields colocd depends on (issue 13 item 5).

kubeconform is a Go binary fetched from outside the package registries, so it cannot be installed
here; these checks read the manifests as YAML and assert what matters to colocd: host IPC and host
network, the hostPath directories (socket, journal, /dev/shm), probes on /healthz and /readyz on the
port the daemon listens on, Prometheus scrape annotations pointing at /metrics on that port, the
policy ConfigMap holding a document colocd's own loader accepts, and the node config (from the Secret)
validating as a ``NodeConfig``. A minimal structural schema (apiVersion/kind/metadata.name, container
names, volume references) catches the mistakes kubeconform would catch in these fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from colocd.daemon.config import NodeConfig
from colocd.policies import load_policy_yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy/kubernetes/colocd.yaml"


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def one(kind: str) -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == kind]
    return doc


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = one("DaemonSet")["spec"]["template"]["spec"]
    return spec


def container() -> dict[str, Any]:
    [c] = pod_spec()["containers"]
    return c


def node_config() -> NodeConfig:
    secret = one("Secret")
    return NodeConfig.model_validate(yaml.safe_load(secret["stringData"]["node.yaml"]))


def volume_paths() -> dict[str, str]:
    """mountPath -> the volume behind it, described as 'hostPath:/x', 'configMap:name' or 'secret:name'."""
    volumes = {}
    for v in pod_spec()["volumes"]:
        if "hostPath" in v:
            volumes[v["name"]] = f"hostPath:{v['hostPath']['path']}"
        elif "configMap" in v:
            volumes[v["name"]] = f"configMap:{v['configMap']['name']}"
        elif "secret" in v:
            volumes[v["name"]] = f"secret:{v['secret']['secretName']}"
    return {m["mountPath"]: volumes[m["name"]] for m in container()["volumeMounts"]}


# --- structure (what kubeconform would reject) -----------------------------------------------------


@pytest.mark.parametrize("doc", documents(), ids=lambda d: d.get("kind", "?"))
def test_every_document_names_its_api_kind_and_name(doc: dict[str, Any]) -> None:
    expected = {"ConfigMap": "v1", "Secret": "v1", "DaemonSet": "apps/v1"}
    assert doc["kind"] in expected, f"unexpected kind {doc['kind']}"
    assert doc["apiVersion"] == expected[doc["kind"]]
    assert isinstance(doc["metadata"]["name"], str) and doc["metadata"]["name"]


def test_the_daemonset_selector_matches_its_pod_labels_and_every_mount_names_a_volume() -> None:
    ds = one("DaemonSet")["spec"]
    labels = ds["template"]["metadata"]["labels"]
    assert ds["selector"]["matchLabels"].items() <= labels.items()
    names = [v["name"] for v in pod_spec()["volumes"]]
    assert len(names) == len(set(names)), "duplicate volume names"
    assert {m["name"] for m in container()["volumeMounts"]} <= set(names)
    for v in pod_spec()["volumes"]:
        assert len({"hostPath", "configMap", "secret"} & set(v)) == 1, f"volume {v['name']}: one source"


# --- what colocd needs ------------------------------------------------------------------------------


def test_the_pod_shares_the_hosts_ipc_and_network() -> None:
    spec = pod_spec()
    assert spec["hostIPC"] is True, "weight chunks are /dev/shm segments and CUDA IPC handles shared with the node"
    assert spec["hostNetwork"] is True, "engines listen on the node's loopback"
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_socket_journal_and_shared_memory_live_on_host_paths() -> None:
    mounts = volume_paths()
    assert mounts["/run/colocd"] == "hostPath:/run/colocd"  # the socket directory trainer pods share
    assert mounts["/var/lib/colocd"] == "hostPath:/var/lib/colocd"
    assert mounts["/dev/shm"] == "hostPath:/dev/shm"
    config = node_config()
    assert config.journal is not None and config.journal.startswith("/var/lib/colocd/")
    assert config.listen.ready_file is not None and config.listen.ready_file.startswith("/run/colocd/")


def test_probes_ask_healthz_and_readyz_on_the_port_the_daemon_listens_on() -> None:
    c = container()
    port = node_config().listen.port
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["containerPort"] for p in c["ports"]} == {port}
    # Probes come from the kubelet on the node's IP, not its loopback.
    assert node_config().listen.host == "0.0.0.0"


def test_a_daemon_reachable_beyond_loopback_requires_a_token() -> None:
    assert node_config().token, "listening on every address: mutating routes must need the bearer token"
    assert "Secret" in {d["kind"] for d in documents()}  # so the token is not in a ConfigMap


def test_prometheus_scrapes_metrics_on_the_daemons_port() -> None:
    annotations = one("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(node_config().listen.port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_policy_configmap_holds_a_document_colocd_accepts_where_the_daemon_reads_it() -> None:
    cm = one("ConfigMap")
    load_policy_yaml(cm["data"]["policies.yaml"], source="colocd-policy ConfigMap")  # raises if invalid
    policy_file = node_config().policy_file
    assert policy_file is not None
    directory, name = policy_file.rsplit("/", 1)
    assert volume_paths()[directory] == f"configMap:{cm['metadata']['name']}" and name in cm["data"]


def test_the_container_runs_colocd_serve_on_the_mounted_node_config() -> None:
    args = container()["args"]
    assert args[:2] == ["serve", "--config"]
    directory, name = args[2].rsplit("/", 1)
    assert volume_paths()[directory] == f"secret:{one('Secret')['metadata']['name']}"
    assert name in one("Secret")["stringData"]


def test_the_systemd_unit_serves_the_node_config_and_may_write_its_state() -> None:
    unit = (REPO / "deploy/systemd/colocd.service").read_text()
    lines = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert lines["ExecStart"].endswith("colocd serve --config /etc/colocd/node.yaml")
    assert lines["ExecReload"] == "/bin/kill -HUP $MAINPID"  # SIGHUP reloads the policy file
    assert {"/var/lib/colocd", "/run/colocd", "/dev/shm"} <= set(lines["ReadWritePaths"].split())
