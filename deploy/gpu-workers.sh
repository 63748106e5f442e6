#!/bin/sh
# One GPU worker service per GPU of this host, for docker compose (docs/DEPLOY.md):
#
#   deploy/gpu-workers.sh 4 > docker-compose.override.yml
#   COMPOSE_PROFILES=gpu docker compose up
#
# docker-compose.yml's `worker` holds GPU 0; this writes worker-gpu1 .. worker-gpuN-1, each the same
# service pinned to its own device id. (Compose gives every replica of one service the same
# device, so `--scale worker=N` would stack N workers on GPU 0.) `!override` replaces the inherited
# device list instead of appending to it; it needs Docker Compose >= 2.24.4.
set -eu
num_gpus=${1:?usage: $0 NUM_GPUS}
case "$num_gpus" in ''|*[!0-9]*) echo "NUM_GPUS must be a number" >&2; exit 2 ;; esac
echo "# Written by deploy/gpu-workers.sh $num_gpus; GPU 0 is docker-compose.yml's \`worker\`."
echo "services:"
i=1
while [ "$i" -lt "$num_gpus" ]; do
    cat <<YAML
  worker-gpu$i:
    extends: {file: docker-compose.yml, service: worker}
    deploy:
      resources:
        reservations:
          devices: !override
            - driver: nvidia
              device_ids: ["$i"]
              capabilities: [gpu]
YAML
    i=$((i + 1))
done
if [ "$num_gpus" -le 1 ]; then echo "  {}"; fi
