"""compose.yaml's "cluster" profile matches deploy/haproxy.cfg: every node the proxy names is a
slotserve service of the profile, on one Redis, each with its own hostname (its lease node id).

Docker is not needed: the files are read (PyYAML, as Compose reads them) and compared."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_cluster_profile_runs_every_node_the_proxy_routes_to() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    cluster = {n: s for n, s in services.items() if "cluster" in s.get("profiles", ["cluster"])}
    assert {"redis", "haproxy"} <= set(cluster)
    proxy = cluster["haproxy"]
    assert "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in proxy["volumes"]
    names = set(re.findall(r"\$\{(SLOTSERVE_NODE\d+)\}", (ROOT / "deploy" / "haproxy.cfg").read_text()))
    assert names and names <= set(proxy["environment"]), "every node the proxy names is set"
    nodes = [proxy["environment"][n].partition(":")[0] for n in sorted(names)]
    assert len(set(nodes)) == len(nodes) >= 3
    hostnames = set()
    for node in nodes:
        service = cluster[node]
        assert service["build"]["dockerfile"] == "Dockerfile" and "redis" in service["depends_on"]
        hostnames.add(service["hostname"])
    assert len(hostnames) == len(nodes), "each node its own hostname: its own lease node id"
    assert "redis-server" in cluster["redis"]["command"] and "noeviction" in cluster["redis"]["command"]


def test_the_gpu_profile_runs_one_offloaded_node_per_gpu_behind_the_same_proxy() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    proxy = services["haproxy-gpu"]
    assert proxy["profiles"] == ["gpu"]
    assert "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in proxy["volumes"]
    names = set(re.findall(r"\$\{(SLOTSERVE_NODE\d+)\}", (ROOT / "deploy" / "haproxy.cfg").read_text()))
    nodes = [proxy["environment"][n].partition(":")[0] for n in sorted(names)]
    gpus = []
    for node in nodes:
        service = services[node]
        assert service["profiles"] == ["gpu"] and "redis" in service["depends_on"]
        assert service["build"]["args"]["SLOTSERVE_BACKEND"] == "cuda"
        command = service["command"]
        assert int(command[command.index("--n-gpu-layers") + 1]) >= 99, "every layer offloaded"
        assert "redis://redis:6379/0" in command, "the one Redis"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        gpus.extend(device["device_ids"])
    assert len(gpus) == len(set(gpus)) == len(nodes), "one GPU per node, each its own"
    assert len({services[n]["hostname"] for n in nodes}) == len(nodes)
