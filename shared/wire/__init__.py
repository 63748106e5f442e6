"""The wire contract between gateway, worker, dashboard and batch jobs: every Redis key, every
message and stored record with its encoding, and every Lua script with its KEYS and ARGV.

Nothing that crosses Redis is defined anywhere else: build keys with `Keys`; write and read stored
records through their `encode`/`decode` (hash or stream fields) and messages through `pack`/
`unpack` (msgpack bytes); run the scripts through the call builders of `scripts` and
`batch_scripts` (`scripts.enqueue(...)` gives the KEYS and ARGV of one ENQUEUE call).

    keys.py           Keys (every key name), PRIORITIES
    messages.py       SamplingParams, GenerationRequest, TokenEvent, TokenLogprob, Usage (msgpack)
    constraint.py     OutputConstraint (the grammar of a constrained request, inside SamplingParams)
    status.py         RequestStatus and its finish reasons
    checkpoint.py     the checkpoint codec (uint32 little-endian token ids)
    records.py        QueueEntry (stream entry), RequestRecord (request hash), DeadLetterEntry
    timeline.py       RequestTimeline (a finished request's phases on its worker), its summary
    heartbeat.py      Heartbeat (a worker's hash)
    api_keys.py       ApiKeyRecord
    batch.py          BatchStatus, FileRecord, BatchRecord
    lua.py            LuaScript, ScriptCall
    scripts.py        ENQUEUE, READ_IF_FITS, START_ATTEMPT, PUBLISH, PUBLISH_STEP, ROSTER, RATE_LIMIT
    batch_scripts.py  TRANSITION, RECORD_RESULT, BEGIN_FINALIZE, RENEW_LEASE, RELEASE_LEASE
"""

from kvfleet.shared.wire.api_keys import ApiKeyRecord, api_key_field
from kvfleet.shared.wire.batch import BatchRecord, BatchStatus, FileRecord
from kvfleet.shared.wire.checkpoint import decode_checkpoint, encode_checkpoint
from kvfleet.shared.wire.constraint import ConstraintError, OutputConstraint
from kvfleet.shared.wire.heartbeat import Heartbeat
from kvfleet.shared.wire.keys import PRIORITIES, Keys
from kvfleet.shared.wire.lua import LuaScript, ScriptCall
from kvfleet.shared.wire.messages import GenerationRequest, SamplingParams, TokenEvent, TokenLogprob, Usage
from kvfleet.shared.wire.records import DeadLetterEntry, QueueEntry, RequestRecord
from kvfleet.shared.wire.status import RequestStatus

__all__ = [
    "PRIORITIES", "ApiKeyRecord", "BatchRecord", "BatchStatus", "ConstraintError",
    "DeadLetterEntry", "FileRecord", "OutputConstraint",
    "GenerationRequest", "Heartbeat", "Keys", "LuaScript", "QueueEntry", "RequestRecord",
    "RequestStatus", "SamplingParams", "ScriptCall", "TokenEvent", "TokenLogprob", "Usage",
    "api_key_field", "decode_checkpoint", "encode_checkpoint",
]
