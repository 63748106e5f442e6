"""`docker compose --profile observability`: the Prometheus and Grafana services of
docker-compose.yml hold together with their files under deploy/prometheus and deploy/grafana
(through `docker compose config` where the compose plugin works, else parsed as YAML after the
same interpolation: tests/test_compose.py). Whether each query of the dashboard names metrics the
fleet exports is checked against live /metrics in tests/integration/test_grafana_dashboard.py;
here, that the dashboard covers what it is for, and the PromQL tokenizer that check relies on."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.helpers.promql import dashboard_queries, exported_names, metric_names
from tests.test_compose import (OBSERVABILITY_SERVICES, ROOT, SOURCES, command_of,
                                environment_of, healthcheck_test, host_ports, load_compose)

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvfleet.json"
IMAGES = {"prometheus": ("PROMETHEUS_IMAGE", "KVFLEET_PROMETHEUS_IMAGE"),
          "grafana": ("GRAFANA_IMAGE", "KVFLEET_GRAFANA_IMAGE")}
CUSTOM = {"KVFLEET_PROMETHEUS_IMAGE": "local/prometheus:3",
          "KVFLEET_GRAFANA_IMAGE": "local/grafana:11",
          "KVFLEET_PROMETHEUS_HOST_PORT": "19090", "KVFLEET_GRAFANA_HOST_PORT": "13000"}
# What the issue asks the dashboard to show, by the metrics that show it.
COVERAGE = {
    "the four numbers": {"kvfleet_gateway_time_to_first_token_seconds_bucket",
                         "kvfleet_gateway_inter_token_latency_seconds_sum",
                         "kvfleet_gateway_stream_tokens_per_second_bucket",
                         "kvfleet_worker_output_tokens_total",
                         "kvfleet_worker_cost_per_hour_dollars"},
    "KV use per worker": {"kvfleet_worker_kv_usage_ratio", "kvfleet_worker_kv_blocks_used"},
    "cached share and routing": {"kvfleet_worker_prefix_cache_hit_tokens_total",
                                 "kvfleet_worker_prefix_cache_queried_tokens_total",
                                 "kvfleet_gateway_routed_total",
                                 "kvfleet_gateway_routed_to_worker_total",
                                 "kvfleet_gateway_routed_cached_tokens_total"},
    "pace against the targets, room": {"kvfleet_worker_itl_seconds_bucket",
                                       "kvfleet_worker_target_itl_seconds",
                                       "kvfleet_worker_ttft_seconds_bucket",
                                       "kvfleet_worker_target_ttft_seconds",
                                       "kvfleet_worker_pace_room", "kvfleet_fleet_pace_room"},
    "LoRA": {"kvfleet_worker_lora_requests_total", "kvfleet_worker_lora_loads_total"},
    "speculation": {"kvfleet_worker_spec_decode_num_accepted_tokens_total",
                    "kvfleet_worker_spec_decode_num_draft_tokens_total"},
    "handoffs and resumes": {"kvfleet_worker_handoffs_total",
                             "kvfleet_worker_handoff_fallbacks_total",
                             "kvfleet_worker_takeovers_total"},
    "the host tier's hits by tier": {"kvfleet_worker_prefix_cache_tier_hit_tokens_total"},
    "prefixes fetched from peers": {"kvfleet_worker_kv_peer_fetches_total",
                                    "kvfleet_worker_kv_peer_fetched_blocks_total",
                                    "kvfleet_worker_kv_peer_served_blocks_total"},
}


@pytest.fixture(scope="module", params=SOURCES)
def services(request) -> dict:
    return load_compose(request.param, {})["services"]


@pytest.fixture(scope="module", params=SOURCES)
def custom_services(request) -> dict:
    return load_compose(request.param, CUSTOM)["services"]


def dockerfile_of(name: str) -> str:
    return (DEPLOY / name / "Dockerfile").read_text()


def prometheus_config() -> dict:
    return yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("name", OBSERVABILITY_SERVICES)
def test_the_observability_services_run_only_in_their_profile(services, name):
    service = services[name]
    assert service["profiles"] == ["observability"]
    assert healthcheck_test(service)
    assert "container_name" not in service
    # published on the host's loopback only, like the gateway and Redis
    (published,) = host_ports(service)
    assert published[0] == "127.0.0.1"


@pytest.mark.parametrize("name", OBSERVABILITY_SERVICES)
def test_their_images_are_built_from_a_build_argument_with_a_default(services, custom_services,
                                                                     name):
    arg, variable = IMAGES[name]
    text = dockerfile_of(name)
    default = re.search(rf"^ARG {arg}=(\S+)$", text, re.M)
    assert default and re.search(rf"^FROM \${{{arg}}}$", text, re.M)
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)  # no frontend to pull
    build = services[name]["build"]
    assert build["args"][arg] == default[1]  # compose's default is the Dockerfile's
    assert custom_services[name]["build"]["args"][arg] == CUSTOM[variable]
    assert str(build["context"]).rstrip("/").endswith(f"deploy/{name}")
    for line in text.splitlines():
        if line.startswith("COPY "):
            assert (DEPLOY / name / line.split()[1]).exists(), line
    ports = {"prometheus": "19090", "grafana": "13000"}
    assert host_ports(custom_services[name]) == [("127.0.0.1", ports[name])]


def test_a_prometheus_image_made_from_debian_fits_the_service(services):
    """deploy/prometheus/debian.Dockerfile (for hosts with Debian's mirror and no registry) makes
    an image the compose service runs as it runs prom/prometheus: flags after the entrypoint, data
    in /prometheus, wget for the healthcheck (docs/DEPLOY.md: it ran on 2026-12-06)."""
    text = (DEPLOY / "prometheus" / "debian.Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    install = text.split("apt-get install", 1)[1].split("&&", 1)[0]
    assert {"prometheus", "wget"} <= set(install.split())
    assert re.search(r'^ENTRYPOINT \["/usr/bin/prometheus"\]$', text, re.M)
    assert "install -d -o prometheus -g prometheus /prometheus" in text
    assert re.search(r"^USER prometheus$", text, re.M)
    service = services["prometheus"]
    assert all(arg.startswith("--") for arg in command_of(service))  # flags for the entrypoint
    assert "--storage.tsdb.path=/prometheus" in command_of(service)
    assert healthcheck_test(service).split()[:2] == ["CMD", "wget"]


def test_prometheus_scrapes_the_gateway_and_every_worker_service(services):
    jobs = {job["job_name"]: job for job in prometheus_config()["scrape_configs"]}
    gateway_command = command_of(services["gateway"])
    gateway_port = gateway_command[gateway_command.index("--port") + 1]
    (static,) = jobs["kvfleet-gateway"]["static_configs"]
    assert static["targets"] == [f"gateway:{gateway_port}"]
    (dns,) = jobs["kvfleet-worker"]["dns_sd_configs"]
    workers = {name for name, s in services.items() if command_of(s)[:2] == ["kvfleet", "worker"]}
    assert workers == {"worker", "worker-cpu"} and set(dns["names"]) == workers
    assert dns["type"] == "A"
    for name in workers:  # the port each worker serves /metrics on
        assert environment_of(services[name])["KVFLEET_METRICS_PORT"] == str(dns["port"])
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())


def test_grafana_provisions_the_datasource_and_the_dashboard(services):
    provisioning = DEPLOY / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"  # the service, on Prometheus's own port
    assert "9090" in str(services["prometheus"]["ports"][0])
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvfleet.yml").read_text())[
        "providers"]
    copied = dict(re.findall(r"^COPY (\S+) (\S+)$", dockerfile_of("grafana"), re.M))
    assert copied["dashboards/"].rstrip("/") == provider["options"]["path"]
    home = environment_of(services["grafana"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARD.name
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    board = dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    for panel in panels:  # every query goes to the provisioned datasource
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == source["uid"]
                                        for t in panel["targets"]), panel["title"]


def test_the_dashboard_covers_what_it_is_for():
    named = set().union(*(metric_names(expr) for _, expr in dashboard_queries(dashboard())))
    missing = {area: sorted(names - named) for area, names in COVERAGE.items() if names - named}
    assert not missing


def test_the_dashboard_panels_do_not_overlap():
    taken = set()
    for panel in dashboard()["panels"]:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(box["x"], box["x"] + box["w"])
                 for y in range(box["y"], box["y"] + box["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells


@pytest.mark.parametrize("expr, names", [
    ("histogram_quantile(0.99, sum by (worker, le) (rate(a_seconds_bucket[$__rate_interval])))",
     {"a_seconds_bucket"}),
    ('sum(rate(b_total{route="c_total", x=~"$model"}[5m])) * 1e6 / 3600', {"b_total"}),
    ("x / on (job) group_left (instance) up offset 5m", {"x", "up"}),
    ("max without (worker) (d) > bool 0.5 and e unless f", {"d", "e", "f"}),
    ("count(NaN) + label_replace(g, 'a', 'b', 'c', 'd')", {"g"}),
])
def test_the_tokenizer_finds_metric_names_only(expr, names):
    assert metric_names(expr) == names


def test_exported_names_map_histograms_and_counters_as_prometheus_does():
    text = "\n".join([
        "# TYPE h_seconds histogram", 'h_seconds_bucket{le="1.0"} 1', "h_seconds_count 1",
        "# TYPE c_total counter", "c_total 3", "c_created 1.7e9",
        "# TYPE om counter",  # OpenMetrics names a counter's family without _total
        "# TYPE lab_total counter",  # a labelled family with no series yet
        "# TYPE g gauge", "g 1"])
    names = exported_names(text)
    assert {"h_seconds_bucket", "h_seconds_sum", "h_seconds_count", "c_total", "om_total",
            "lab_total", "g"} <= names
    assert not {"h_seconds", "c", "om", "lab"} & names
