#!/usr/bin/env bash
# Smoke test of the compose fleet with a real Docker engine (not part of CI; results in
# docs/DEPLOY.md): build; plain `docker compose up`; a streamed chat; scale to two CPU workers;
# SIGKILL the worker serving a streamed answer mid-stream and check that the answer continues with
# exactly the text of an uninterrupted run; tear everything down (containers, volumes).
#
#   deploy/smoke.sh
#
# Uses the compose variables (docs/DEPLOY.md), e.g. KVFLEET_BASE_IMAGE / KVFLEET_REDIS_IMAGE for
# locally made base images (deploy/base-image.sh), KVFLEET_TORCH_INDEX, and the host ports
# KVFLEET_GATEWAY_HOST_PORT / KVFLEET_REDIS_HOST_PORT (defaults here: 18000 / 16379, so that a
# Redis or gateway already on the host is no obstacle). KEEP=1 leaves the fleet up on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-kvfleet-smoke}
export KVFLEET_GATEWAY_HOST_PORT=${KVFLEET_GATEWAY_HOST_PORT:-18000}
export KVFLEET_REDIS_HOST_PORT=${KVFLEET_REDIS_HOST_PORT:-16379}
export KVFLEET_WORKER_CPUS=${KVFLEET_WORKER_CPUS:-1}
URL="http://127.0.0.1:${KVFLEET_GATEWAY_HOST_PORT}"
MODEL=SmolLM2-135M-Instruct
MAX_TOKENS=${SMOKE_MAX_TOKENS:-200}
WORK=$(mktemp -d /tmp/kvfleet-smoke.XXXXXX)

log() { printf '[smoke %s] %s\n' "$(date +%T)" "$*"; }
fail() { log "FAILED: $*"; docker compose logs --tail 40 >&2 || true; exit 1; }
teardown() {
    if [ "${KEEP:-0}" != 1 ]; then
        log "tearing down"
        docker compose down --volumes --remove-orphans >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
}
trap teardown EXIT

redis() { docker compose exec -T redis redis-cli --raw "$@"; }
have_workers() { [ "$(redis --scan --pattern 'kvf:worker:*' | grep -c .)" -ge "$1" ]; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@"; do
        [ $SECONDS -lt $deadline ] || fail "timed out waiting for $what"
        sleep 1
    done
}

# stream_chat OUT: a streamed greedy chat of MAX_TOKENS tokens; writes the SSE lines to OUT.
stream_chat() {
    curl -sS -N --max-time 900 "$URL/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\": \"$MODEL\", \"stream\": true, \"temperature\": 0, \"ignore_eos\": true,
             \"max_tokens\": $MAX_TOKENS,
             \"messages\": [{\"role\": \"user\", \"content\": \"Tell me a long story about a lighthouse keeper.\"}]}" \
        >"$1"
}
# sse_field OUT FIELD: text | id | finish_reason | chunks, read from the SSE lines.
sse_field() {
    python3 - "$1" "$2" <<'PY'
import json, sys
path, field = sys.argv[1], sys.argv[2]
chunks = [json.loads(line[6:]) for line in open(path) if line.startswith("data: {")]
errors = [c["error"] for c in chunks if "error" in c]
if errors:
    sys.exit(f"error chunk: {errors[0]}")
if field == "id":
    print(chunks[0]["id"] if chunks else "")
elif field == "chunks":
    print(len(chunks))
elif field == "finish_reason":
    print(next((c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0].get("finish_reason")), ""))
else:
    print("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]),
          end="")
PY
}

log "build (base image: ${KVFLEET_BASE_IMAGE:-default})"
started=$SECONDS
docker compose build >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; fail "build"; }
log "built in $((SECONDS - started)) s; image size: $(docker image inspect kvfleet:cpu --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"

log "docker compose up (no flags)"
docker compose up -d >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; fail "up"; }
wait_for 300 "the gateway" curl -sf "$URL/ready" -o /dev/null
wait_for 300 "a worker's heartbeat" have_workers 1
log "serving: $(docker compose ps --format '{{.Service}}' | sort | tr '\n' ' ')"

log "streamed chat (reference, one worker)"
stream_chat "$WORK/reference.sse"
reference=$(sse_field "$WORK/reference.sse" text)
[ "$(sse_field "$WORK/reference.sse" finish_reason)" = length ] || fail "reference did not finish"
grep -q '^data: \[DONE\]' "$WORK/reference.sse" || fail "no [DONE]"
log "reference: $(sse_field "$WORK/reference.sse" chunks) chunks, ${#reference} characters"

log "scale to two workers: docker compose up --scale worker-cpu=2"
docker compose up -d --scale worker-cpu=2 --no-recreate >>"$WORK/up.log" 2>&1 || fail "scale"
wait_for 300 "two workers' heartbeats" have_workers 2
threads=$(docker compose logs worker-cpu 2>/dev/null | grep -o 'torch threads: [0-9]*' | sort | uniq -c)
log "CPU workers (limit ${KVFLEET_WORKER_CPUS} CPU each): ${threads:-no thread cap logged}"

log "streamed chat; SIGKILL its worker mid-stream"
stream_chat "$WORK/killed.sse" &
client=$!
req_id=""
wait_for 120 "the stream to start" bash -c "grep -q '^data: {' '$WORK/killed.sse'"
req_id=$(sse_field "$WORK/killed.sse" id)
progress() { echo $(( $(redis strlen "kvf:req:{$req_id}:ckpt") / 4 )); }
past_20_tokens() { [ "$(progress)" -ge 20 ]; }
wait_for 300 "20 tokens" past_20_tokens
owner=$(redis hget "kvf:req:{$req_id}" worker)  # worker ids start with the container's hostname
victim=$(docker compose ps -q worker-cpu | while read -r id; do
    case "$owner" in "${id:0:12}"-*) echo "$id" ;; esac; done)
[ -n "$victim" ] || fail "no container for worker $owner"
at=$(progress)
docker kill --signal KILL "$victim" >/dev/null
log "killed $owner (container ${victim:0:12}) at token $at of $MAX_TOKENS"
wait "$client" || fail "the client's stream broke"
resumed=$(sse_field "$WORK/killed.sse" text)
attempt=$(redis hget "kvf:req:{$req_id}" attempt)
rescuer=$(redis hget "kvf:req:{$req_id}" worker)
[ "$(sse_field "$WORK/killed.sse" finish_reason)" = length ] || fail "the answer did not finish"
[ "$attempt" = 2 ] || fail "attempt is $attempt, expected 2 (one takeover)"
[ "$rescuer" != "$owner" ] || fail "the answer was not resumed by the other worker"
if [ "$resumed" != "$reference" ]; then
    diff <(printf '%s\n' "$reference") <(printf '%s\n' "$resumed") | head -20
    fail "the resumed answer differs from the uninterrupted one"
fi
log "answer continued on $rescuer: identical to the reference (${#resumed} characters, attempt $attempt)"
log "PASSED"
