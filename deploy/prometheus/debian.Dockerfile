# A Prometheus image made from Debian's `prometheus` package, for hosts that reach Debian's
# package mirror but no image registry; it serves as KVFLEET_PROMETHEUS_IMAGE, from which
# deploy/prometheus/Dockerfile builds the compose service (docs/DEPLOY.md, "Without an image
# registry"). BASE_IMAGE: any Debian bookworm image, e.g. deploy/base-image.sh's:
#   docker build -t kvfleet-local/prometheus:2 -f deploy/prometheus/debian.Dockerfile \
#       --build-arg BASE_IMAGE=kvfleet-local/bookworm-python:3.11 deploy/prometheus
# Like prom/prometheus: prometheus is the entrypoint, it runs unprivileged, keeps its data in
# /prometheus, and wget is there for the compose healthcheck.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus wget >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o prometheus -g prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
