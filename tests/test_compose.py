"""The deployment files hold together: docker-compose.yml (through `docker compose config` where
the compose plugin works, else parsed as YAML after the same variable interpolation, with the same
checks), .env, deploy/gpu-workers.sh, the Dockerfile's shape, and the Kubernetes examples in
deploy/k8s. deploy/smoke.sh runs the real thing with a Docker engine (docs/DEPLOY.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvfleet.cli import build_parser
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Keys

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
KVFLEET_SERVICES = ("gateway", "worker", "worker-cpu", "batch")
OBSERVABILITY_SERVICES = ("prometheus", "grafana")  # --profile observability
REDIS_URL = "redis://redis:6379/0"
# Compose variables the tests set, so that they must reach the right places.
CUSTOM = {"KVFLEET_GATEWAY_HOST_PORT": "18123", "KVFLEET_REDIS_HOST_PORT": "16399",
          "KVFLEET_WORKER_CPUS": "3", "KVFLEET_BASE_IMAGE": "local/python:3.11",
          "KVFLEET_REDIS_IMAGE": "local/redis:7",
          "KVFLEET_TORCH_FIND_LINKS": "http://10.1.2.3:8765/"}


def compose_plugin_works() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# The YAML check always runs; `docker compose config` (normalised, interpolated) runs as well
# where the compose plugin is installed (a machine with the Docker client alone has the YAML only).
SOURCES = ["yaml", *(["docker-compose-config"] if compose_plugin_works() else [])]


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` and `${VAR}` substitution (all this file uses)."""
    def value(match: re.Match) -> str:
        return env.get(match[1]) or (match[3] or "")
    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", value, text)


class OverrideLoader(yaml.SafeLoader):
    """YAML with Compose's `!override` tag (replace, don't merge, the base file's value)."""


OverrideLoader.add_constructor(
    "!override", lambda loader, node: loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.SequenceNode) else loader.construct_mapping(node, deep=True))


def load_compose(source: str, env: dict[str, str], *extra_files: Path,
                 compose_file: Path = COMPOSE) -> dict:
    if source == "yaml":
        # safe_load resolves the `<<` merge keys
        return yaml.safe_load(interpolate(compose_file.read_text(), env))
    files = [arg for path in (compose_file, *extra_files) for arg in ("-f", str(path))]
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("KVFLEET_", "COMPOSE_"))}
    result = subprocess.run(
        ["docker", "compose", *files, "--profile", "cpu", "--profile", "gpu", "--profile",
         "observability", "config",
         "--format", "json"], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**base_env, **env})
    assert result.returncode == 0, f"docker compose config rejected the file:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.fixture(scope="module", params=SOURCES)
def compose(request) -> dict:
    return load_compose(request.param, {})


@pytest.fixture(scope="module", params=SOURCES)
def custom_compose(request) -> dict:
    return load_compose(request.param, CUSTOM)


def dotenv() -> dict[str, str]:
    lines = (ROOT / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def command_of(service: dict) -> list[str]:
    command = service.get("command") or []  # `docker compose config` writes null for none
    return command.split() if isinstance(command, str) else list(command)


def environment_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def host_ports(service: dict) -> list[tuple[str, str]]:
    """(host ip, host port) of every published port, from the short or the long syntax."""
    published = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            published.append((port.get("host_ip", ""), str(port.get("published", ""))))
            continue
        parts = str(port).split(":")
        if len(parts) == 3:
            published.append((parts[0], parts[1]))
        elif len(parts) == 2:
            published.append(("", parts[0]))
        else:
            published.append(("", "random"))
    return published


def healthcheck_test(service: dict) -> str:
    test = (service.get("healthcheck") or {}).get("test")
    assert test, "no healthcheck"
    return " ".join(test) if isinstance(test, list) else str(test)


def gpu_devices(service: dict) -> list[dict]:
    resources = (service.get("deploy") or {}).get("resources") or {}
    return (resources.get("reservations") or {}).get("devices") or []


def test_the_services_are_the_fleet(compose):
    assert set(compose["services"]) == {"redis", *KVFLEET_SERVICES, *OBSERVABILITY_SERVICES}


def test_redis_persists_with_aof_everysec_and_stays_off_the_network(compose):
    redis = compose["services"]["redis"]
    command = " ".join(command_of(redis))
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert "ping" in healthcheck_test(redis)
    volumes = redis.get("volumes") or []
    targets = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in volumes]
    sources = [v["source"] if isinstance(v, dict) else v.split(":")[0] for v in volumes]
    assert "/data" in targets and "redis-data" in compose.get("volumes", {})
    assert any(source.endswith("redis-data") for source in sources)
    for host_ip, _port in host_ports(redis):
        assert host_ip == "127.0.0.1", "Redis must not be published beyond the loopback"


@pytest.mark.parametrize("name", KVFLEET_SERVICES)
def test_every_kvfleet_service_finds_redis_and_waits_for_it(compose, name):
    service = compose["services"][name]
    assert environment_of(service)["KVFLEET_REDIS_URL"] == REDIS_URL
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert healthcheck_test(service)
    assert "container_name" not in service
    assert command_of(service)[0] == "kvfleet"


def test_every_command_is_one_the_cli_knows(compose):
    from kvfleet import batch_worker

    subcommands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name in KVFLEET_SERVICES:
        args = command_of(compose["services"][name])[1:]
        if args[0] == "batch-worker" and "batch-worker" not in subcommands:
            parser = __import__("argparse").ArgumentParser()
            batch_worker.add_arguments(parser)  # the module `kvfleet batch-worker` runs
            parser.parse_args(args[1:])
            continue
        build_parser().parse_args(args)


def test_the_gateway_is_checked_on_health_and_published_on_loopback(compose):
    gateway = compose["services"]["gateway"]
    assert "/health" in healthcheck_test(gateway)
    assert host_ports(gateway) == [("127.0.0.1", "8000")]
    assert "profiles" not in gateway


def test_host_ports_cpu_share_and_images_come_from_variables(compose, custom_compose):
    assert host_ports(compose["services"]["redis"]) == [("127.0.0.1", "6379")]
    services = custom_compose["services"]
    assert host_ports(services["gateway"]) == [("127.0.0.1", "18123")]
    assert host_ports(services["redis"]) == [("127.0.0.1", "16399")]
    assert services["redis"]["image"] == "local/redis:7"
    for name in KVFLEET_SERVICES:
        assert services[name]["build"]["args"]["BASE_IMAGE"] == "local/python:3.11"
        # a local torch wheel's page where no torch index is reachable; unset: the index alone
        assert services[name]["build"]["args"]["TORCH_FIND_LINKS"] == "http://10.1.2.3:8765/"
        assert compose["services"][name]["build"]["args"]["TORCH_FIND_LINKS"] == ""
    assert float(services["worker-cpu"]["cpus"]) == 3.0
    assert float(compose["services"]["worker-cpu"]["cpus"]) == 2.0


def test_each_cpu_worker_gets_a_cpu_limit_and_threads_to_match(compose):
    worker = compose["services"]["worker-cpu"]
    assert float(worker["cpus"]) > 0
    # 0: the worker sizes its torch threads by the container's CPU quota (worker/cpu_share.py)
    assert environment_of(worker)["KVFLEET_NUM_THREADS"] == "0"


def test_models_live_in_one_cache_volume(compose):
    assert "model-cache" in compose.get("volumes", {})
    for name in ("gateway", "worker", "worker-cpu"):  # the gateway loads the tokenizer
        volumes = compose["services"][name].get("volumes") or []
        mounts = {(v["source"] if isinstance(v, dict) else v.split(":")[0]).split("_")[-1]:
                  v["target"] if isinstance(v, dict) else v.split(":")[1] for v in volumes}
        assert mounts.get("model-cache") == "/home/kvfleet/.cache", name


def test_workers_scale_without_host_ports_or_names(compose):
    for name in ("worker", "worker-cpu"):
        worker = compose["services"][name]
        assert not worker.get("ports"), f"{name}: a host port would stop --scale"
        assert "container_name" not in worker
        assert command_of(worker)[:2] == ["kvfleet", "worker"]


def duration_s(text: str) -> float:
    """Compose's duration (`45s`, `1m30s`, `500ms`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"not a duration: {text}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_a_stopped_worker_drains_within_its_grace_period(compose, name):
    """SIGTERM drains: the grace period must hold the drain timeout, a step and the exit; peers
    reach the handoff port on the compose network, under each replica's own hostname."""
    worker = compose["services"][name]
    env = environment_of(worker)
    drain_s = float(env["KVFLEET_DRAIN_TIMEOUT_S"])
    assert drain_s > 0
    assert duration_s(worker["stop_grace_period"]) >= drain_s + 10
    assert env["KVFLEET_ROLE"] in ("both", "prefill", "decode")
    port = env["KVFLEET_HANDOFF_PORT"]
    assert int(port) > 0 and port in [str(p).split("/")[0] for p in worker.get("expose") or []]
    assert not host_ports(worker)
    assert env.get("KVFLEET_HANDOFF_ADVERTISE_HOST", "") == ""  # the container's hostname


def test_the_gpu_worker_reserves_one_nvidia_gpu_in_the_gpu_profile(compose):
    worker = compose["services"]["worker"]
    (device,) = gpu_devices(worker)
    # A device id, not `count: 1`: every replica of a count-1 service gets the same first GPU.
    assert device["driver"] == "nvidia" and device["device_ids"] == ["0"]
    assert "count" not in device
    capabilities = [c for group in device["capabilities"]
                    for c in (group if isinstance(group, list) else [group])]
    assert capabilities == ["gpu"]
    assert worker["profiles"] == ["gpu"]
    assert environment_of(worker)["KVFLEET_DEVICE"] == "cuda"
    build = worker.get("build") or {}
    assert "cu1" in str((build.get("args") or {}).get("TORCH_INDEX", "")), \
        "the GPU worker must be built from a CUDA torch index"


def test_plain_up_serves_with_a_cpu_worker_and_needs_no_gpu(compose):
    services = compose["services"]
    assert dotenv()["COMPOSE_PROFILES"] == "cpu"  # what a plain `docker compose up` starts
    profiles = set(dotenv()["COMPOSE_PROFILES"].split(","))
    default = {name for name, s in services.items()
               if not s.get("profiles") or profiles & set(s["profiles"])}
    assert default == {"redis", "gateway", "batch", "worker-cpu"}
    assert all(not gpu_devices(services[name]) for name in default)
    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and not gpu_devices(cpu)
    assert environment_of(cpu)["KVFLEET_DEVICE"] == "cpu"
    if compose_plugin_works():  # Compose itself, reading the committed .env as plain `up` does
        base_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("KVFLEET_", "COMPOSE_"))}
        result = subprocess.run(["docker", "compose", "config", "--services"],
                                capture_output=True, text=True, timeout=60, cwd=ROOT, env=base_env)
        assert result.returncode == 0, result.stderr
        assert set(result.stdout.split()) == default


def gpu_workers_override(tmp_path: Path, num_gpus: int) -> Path:
    """The script's output where Compose looks for it: beside (a copy of) docker-compose.yml."""
    result = subprocess.run(["sh", str(ROOT / "deploy" / "gpu-workers.sh"), str(num_gpus)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    shutil.copy(COMPOSE, tmp_path / "docker-compose.yml")
    path = tmp_path / "docker-compose.override.yml"
    path.write_text(result.stdout)
    return path


def test_gpu_workers_sh_gives_each_gpu_its_own_worker_service(tmp_path):
    override_path = gpu_workers_override(tmp_path, 4)
    services = yaml.load(override_path.read_text(), Loader=OverrideLoader)["services"]
    assert set(services) == {"worker-gpu1", "worker-gpu2", "worker-gpu3"}  # GPU 0: `worker`
    for index in (1, 2, 3):
        service = services[f"worker-gpu{index}"]
        assert service["extends"] == {"file": "docker-compose.yml", "service": "worker"}
        (device,) = gpu_devices(service)
        assert device["device_ids"] == [str(index)] and device["driver"] == "nvidia"
    if compose_plugin_works():  # merged by Compose itself: one device each, all distinct
        merged = load_compose("docker-compose-config", {}, override_path,
                              compose_file=tmp_path / "docker-compose.yml")["services"]
        ids = [gpu_devices(merged[name])[0]["device_ids"]
               for name in ("worker", "worker-gpu1", "worker-gpu2", "worker-gpu3")]
        assert all(len(gpu_devices(merged[name])) == 1 for name in merged if "worker-gpu" in name)
        assert ids == [["0"], ["1"], ["2"], ["3"]]
        assert merged["worker-gpu3"]["profiles"] == ["gpu"]


def test_the_batch_worker_feeds_the_gateway(compose):
    batch = compose["services"]["batch"]
    assert command_of(batch) == ["kvfleet", "batch-worker"]
    assert environment_of(batch)["KVFLEET_GATEWAY_URL"] == "http://gateway:8000"
    assert batch["depends_on"]["gateway"]["condition"] == "service_healthy"


# The Dockerfile and .dockerignore.

def test_the_dockerfile_builds_cpu_or_cuda_as_a_non_root_user():
    text = (ROOT / "Dockerfile").read_text()
    # A `# syntax=` line makes BuildKit pull a frontend image: no build without a registry.
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    assert re.search(r"^ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu$", text, re.M)
    assert re.search(r"^ARG TORCH_FIND_LINKS=$", text, re.M)  # empty: the torch index alone
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M)
    assert re.search(r"^USER kvfleet$", text, re.M)
    assert re.search(r"^HEALTHCHECK ", text, re.M)
    # Dependencies are installed from pyproject alone, before any code is copied.
    lines = text.splitlines()
    first_code = min(i for i, line in enumerate(lines) if line.startswith("COPY shared"))
    deps = next(i for i, line in enumerate(lines) if "pip install -r" in line)
    assert deps < first_code
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            source = line.split()[1]
            assert (ROOT / source).exists(), f"COPY of a missing path: {source}"


def test_the_dockerignore_keeps_the_context_small():
    patterns = (ROOT / ".dockerignore").read_text().split()
    assert "*" in patterns and "!pyproject.toml" in patterns  # an allow-list
    assert not any(p.startswith(("!tests", "!benchmarks", "!.venv")) for p in patterns)


# Kubernetes examples.

def k8s_documents() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def test_the_k8s_examples_parse_and_name_the_pieces():
    docs = k8s_documents()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [("Deployment", "kvfleet-gateway"), ("Service", "kvfleet-gateway"),
                     ("HorizontalPodAutoscaler", "kvfleet-gateway"),
                     ("Deployment", "kvfleet-worker"), ("ScaledObject", "kvfleet-worker"),
                     ("Deployment", "kvfleet-batch"), ("StatefulSet", "redis")]:
        assert expected in kinds, expected
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "kvfleet-worker"
    lag = [t["metadata"] for t in scaled["spec"]["triggers"]
           if t["type"] == "redis-streams" and "lagCount" in t["metadata"]]
    assert {t["stream"] for t in lag} >= {Keys().queue("SmolLM2-135M-Instruct")}
    assert all(t["consumerGroup"] == "workers" and int(t["lagCount"]) > 0 for t in lag)
    (worker,) = [d for d in docs if d["kind"] == "Deployment"
                 and d["metadata"]["name"] == "kvfleet-worker"]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # SIGTERM drains: the grace period holds the drain timeout, a step and the exit; peers
    # reach the handoff port at the pod's IP
    env = {e["name"]: e for e in container["env"]}
    drain_s = float(env["KVFLEET_DRAIN_TIMEOUT_S"]["value"])
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_s + 10
    port = int(env["KVFLEET_HANDOFF_PORT"]["value"])
    assert port in [p["containerPort"] for p in container["ports"]]
    assert env["KVFLEET_HANDOFF_ADVERTISE_HOST"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}}
    config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] != "redis":
            env = set()
            for container in doc["spec"]["template"]["spec"]["containers"]:
                env |= {e["name"] for e in container.get("env", [])}
                for source in container.get("envFrom", []):
                    env |= set(config_maps[source["configMapRef"]["name"]])
            assert "KVFLEET_REDIS_URL" in env, doc["metadata"]["name"]


# The containers' health check.

def load_healthcheck():
    spec = importlib.util.spec_from_file_location("kvfleet_healthcheck",
                                                  ROOT / "deploy" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_healthcheck_probes_each_role(redis_url, monkeypatch):
    healthcheck = load_healthcheck()
    monkeypatch.setenv("KVFLEET_REDIS_URL", redis_url)
    assert healthcheck.main(["kvfleet", "batch-worker"]) == 0
    assert healthcheck.main(["kvfleet", "worker"]) == 0  # no fixed metrics port: nothing to probe
    with pytest.raises(OSError):  # nothing listens there: the wrapper turns this into exit 1
        healthcheck.main(["kvfleet", "gateway", "--port", str(free_port())])


def test_the_pace_scaled_object_replaces_the_workers_one():
    """deploy/k8s/pace/: one replica per worker the gateways' metric says the queue needs."""
    path = ROOT / "deploy" / "k8s" / "pace" / "keda-scaledobject.yaml"
    (scaled,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    (lag_scaled,) = [d for d in k8s_documents() if d["kind"] == "ScaledObject"]
    # the same object: applied after worker.yaml it updates it (KEDA: one per Deployment)
    assert (scaled["kind"], scaled["metadata"]["name"]) == ("ScaledObject", "kvfleet-worker")
    assert scaled["spec"]["scaleTargetRef"] == lag_scaled["spec"]["scaleTargetRef"]
    (trigger,) = scaled["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    assert trigger["metadata"]["query"] == \
        'max(kvfleet_fleet_workers_needed{model="SmolLM2-135M-Instruct"})'
    assert trigger["metadata"]["threshold"] == "1"  # one replica per worker needed
