"""The worker's Redis service loop: pull work when the KV pool has room, step the engine, publish.

One thread runs the loop (engine steps and the protocol's writes); a second thread only heartbeats
(from a stats snapshot the loop leaves it) and keeps this worker's stream entries fresh, so a long
step never lets either lapse. An entry joins the refreshed set the moment it is delivered and leaves
it when the request ends here; other workers take entries over only once our heartbeat is gone.

Prefix-affinity routing (`--routing affinity`): after every turn that changed the prefix cache
the loop announces the change (ANNOUNCE_BLOCKS; only the loop drains the engine's record of it),
at every (re)connect the whole cache with `clear` (Redis may have lost it); the heartbeat thread
only keeps the announced set listed, and has the loop announce it whole again when it finds the
set gone from Redis. A dead worker's request is resumed preferably by the worker
holding most of its prompt (`ResumePreference`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import redis

from kvfleet.shared.redis_connect import REDIS_FAILURES, TRANSIENT_FAILURES
from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire import Heartbeat, RequestStatus, TokenEvent, Usage
from kvfleet.shared.wire.scripts import Started
from kvfleet.shared.wire.prefix_hash import lora_root, root_hash
from kvfleet.worker.affinity import PrefixHolders, ResumePreference
from kvfleet.worker.announcer import PrefixAnnouncer
from kvfleet.worker.coalescing import EventCoalescer
from kvfleet.worker.engine.memory.device import DeviceFailure
from kvfleet.worker.engine.engine import Engine, RequestOutput
from kvfleet.worker.engine.lora import LoraRequest
from kvfleet.worker.handoff.coordinator import OFFER_POLL_S, Handoffs
from kvfleet.worker.handoff.drain import Drain
from kvfleet.worker.handoff.peer_prefixes import PeerPrefixes
from kvfleet.worker.handoff.protocol import HandoffProtocol
from kvfleet.worker.handoff.transfer import TransferPlane
from kvfleet.worker.inflight import Inflight, InflightTable, StreamCalls
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.numerics import FleetNumerics
from kvfleet.worker.process.heartbeat_sender import HeartbeatSender
from kvfleet.worker.protocol import Delivery, Publication, WorkerProtocol
from kvfleet.worker.timelines import TimelineRecorder
from kvfleet.worker.tracing import RequestSpans

log = logging.getLogger(__name__)

class WorkerService(HeartbeatSender):
    """Serves one model's request streams with one engine."""

    def __init__(self, settings: WorkerSettings, engine: Engine, client: redis.Redis,
                 protocol: WorkerProtocol, metrics: WorkerMetrics | None = None,
                 metrics_url: str | None = None, plane: TransferPlane | None = None, *,
                 drain: threading.Event | None = None, tracer_provider=None):
        self.settings = settings
        self.metrics = metrics or WorkerMetrics(protocol.worker_id, protocol.model,
                                                settings.cost_per_hour)
        self.metrics_url = metrics_url
        self.engine = engine
        # None: batch-invariant (worker/engine/model/invariance.py); else why not
        self.metrics.batch_invariant.set(getattr(engine, "invariance_gap", "unknown") is None)
        self.client = client
        self.protocol = protocol
        self.metrics.numerics(protocol.numerics)
        self.numerics = FleetNumerics(client, protocol.keys, protocol.model, protocol.worker_id,
                                      protocol.numerics, settings.numerics_prefer_ms,
                                      settings.heartbeat_interval_s)
        # the streams served here, and their entries the heartbeat thread keeps fresh
        self.inflight = InflightTable()
        self._backlog: list[Publication] = []  # produced but not yet published (Redis was down)
        self.coalescer = EventCoalescer(settings.publish_interval_ms / 1000)
        self.timelines = TimelineRecorder(  # and the spans, with a tracer provider (tracing on)
            protocol.worker_id, settings.timelines_kept,
            spans=RequestSpans.of(tracer_provider, protocol.model))
        # The heartbeat the thread writes next (the protocol stamps model and time).
        self._stats_snapshot = Heartbeat(model=protocol.model, ts=0.0)
        self._lock = threading.Lock()  # the stats snapshot: the loop writes, the heartbeat reads
        self._load_changed = threading.Event()  # the loop's running/waiting changed: beat soon
        self._pubsub = None
        self._last_orphan_check = 0.0
        # Prefix-affinity routing: blocks hash from the served model's root (the router's)
        self.affinity = settings.routing == "affinity"
        self.prefix_root = root_hash(protocol.model)
        engine.set_prefix_root(self.prefix_root)
        self.announcer = PrefixAnnouncer(engine, protocol, self.metrics, settings.heartbeat_ttl_s)
        # KV handoffs (worker/handoff/): the role, the drain, the transfer plane
        self.role = settings.role
        # set by SIGTERM, or by the heartbeat thread when it finds the drain key
        self.drain = drain or threading.Event()
        redis_calls = HandoffProtocol(client, protocol.keys, protocol.model, protocol.worker_id,
                                      protocol.numerics)
        streams = StreamCalls(self.flush, self.stream_left, self.give_back, self.resume,
                              self.adopt)
        gap = engine.handoff_gap()
        if plane is not None and gap is not None:
            log.warning("KV handoffs off: %s (drain and --role prefill resume from checkpoints)",
                        gap)
            plane.close()
            plane = None
        self.handoffs = Handoffs(settings, engine, self.metrics, redis_calls, self.numerics,
                                 self.inflight, streams, protocol.claim_handed, plane)
        self.drainer = Drain(settings.drain_timeout_s, engine, self.metrics, self.inflight,
                             self.handoffs, streams)
        # prefixes fetched from peers (worker/handoff/peer_prefixes.py), and served to them
        holders = PrefixHolders(client, protocol.keys, protocol.model, protocol.worker_id,
                                ttl_ms=int(settings.heartbeat_ttl_s * 1000),
                                refresh_s=settings.heartbeat_interval_s)
        self.peers = PeerPrefixes(settings, engine, self.metrics.tier, holders,
                                  protocol.numerics, self.prefix_root, plane, self._enter)
        if plane is not None and self.peers.copies is not None:
            self.handoffs.prefix_provider = self.peers.provide
        if self.role != "both" and plane is None:
            log.warning("--role %s without KV handoffs: a prefill worker decodes its streams "
                        "itself, a decode worker serves only orphaned requests", self.role)

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set (or a drain ends); survive Redis outages with backoff."""
        self._snapshot_stats()
        beat = threading.Thread(target=self._heartbeat_loop, args=(stop,), daemon=True)
        beat.start()
        backoff_s = 0.1
        while not stop.is_set():
            try:
                if self._pubsub is None:
                    self.connect()
                self.run_once()
                if self.drainer.active and self.drainer.over():
                    stop.set()
                backoff_s = 0.1
            except TRANSIENT_FAILURES as exc:  # also a cluster failing over
                log.warning("redis unavailable (%r); retrying in %.1f s", exc, backoff_s)
                self._pubsub = None
                stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)
            except DeviceFailure:
                # every later step would fail too: exit with the requests still pending, so
                # other workers claim them once the heartbeat lapses
                log.critical("device failure: exiting; %d requests resume elsewhere",
                             len(self.inflight))
                stop.set()
                self._stop_beating(beat)
                raise
        self._stop_beating(beat)
        self.handoffs.close()
        self.peers.close()

    def _stop_beating(self, beat: threading.Thread) -> None:
        """Stop the heartbeat thread, then remove the heartbeat: in the other order a beat in
        flight could write it again after its removal."""
        self._load_changed.set()  # the heartbeat thread sees `stop` at once
        beat.join(timeout=2)
        self._shutdown()

    def connect(self) -> None:
        # Heartbeat before the first read: an entry delivered to a worker without a heartbeat key
        # would look orphaned to the others.
        self._snapshot_stats()
        self._beat()
        self.protocol.ensure_groups()
        self.handoffs.redis.load_scripts()
        if self.affinity:
            self.announcer.announce_all()
        self._pubsub = self.protocol.subscribe_cancels()

    def _shutdown(self) -> None:
        """Leave unfinished work pending: another worker claims it once our heartbeat is gone."""
        try:
            self.protocol.remove_heartbeat()
        except redis.RedisError:
            pass
        if self.inflight:
            log.info("stopping with %d requests in flight; they resume elsewhere",
                     len(self.inflight))

    # ---- one iteration ---------------------------------------------------------------------

    def run_once(self) -> None:
        """Cancel, hand over, admit, step, publish, offer: one turn of the loop."""
        if self._backlog:  # publish what a Redis outage held back before producing more
            self._publish_items([])
        self._handle_cancels()
        if self.drain.is_set() and not self.drainer.active:
            self.peers.release_all()  # its requests go to peers with the rest
            self.drainer.begin()
            self._load_changed.set()  # beat now: routers stop sending here
        handoffs = self.handoffs
        handoffs.serve_asks()
        if handoffs.handed:
            handoffs.resolve_handed()
        if handoffs.incoming:
            handoffs.complete_incoming()
        self.peers.complete()
        if not self.drainer.active:
            self._admit(block=not self.engine.has_unfinished() and not handoffs.busy
                        and not self.peers.busy)
        if self.peers.busy and not self.engine.has_unfinished():
            self.peers.wait(OFFER_POLL_S)  # nothing to step meanwhile: no spinning
        if self.engine.has_unfinished():
            started = time.perf_counter()
            outputs = self.engine.step()
            step_time_s = time.perf_counter() - started
            self._publish_outputs(outputs)
            self.metrics.step_done(outputs, self.engine.stats(), step_time_s)
        if handoffs.enabled and (self.drainer.active or self.role == "prefill"):
            draining = self.drainer.active
            handoffs.offer_streams("drain" if draining else "prefill", first_token_out=not draining)
        self._snapshot_stats()
        if self.affinity:
            self.announcer.announce()

    def _handle_cancels(self) -> None:
        while (req_id := self.protocol.next_cancel(self._pubsub)) is not None:
            self.peers.release(req_id)  # waiting for its prefix: in the engine, to abort it
            if req_id in self.inflight:
                output = self.engine.abort(req_id)
                log.info("cancelled %s", req_id)
                if output is not None:
                    self.metrics.request_finished("abort")
                    self._publish_outputs([output])

    # ---- admission -------------------------------------------------------------------------

    def _admit(self, block: bool) -> None:
        """Take new work only while the KV pool holds its prompt plus the watermark: what does
        not fit stays queued for a worker with room."""
        now = time.monotonic()
        if now - self._last_orphan_check >= self.settings.heartbeat_interval_s:
            self._last_orphan_check = now
            self._claim_orphans()
        stats = self.engine.stats()
        if stats.num_waiting > 0:  # work already here that does not fit yet
            return
        # Requests just admitted hold no blocks until the scheduler runs them: the budget is taken
        # once and what they will need is subtracted from it (and the room streams being
        # fetched were promised).
        budget_tokens = self._budget_tokens()
        want = self._want()
        if self.handoffs.enabled and self.role != "prefill":  # streams offered with their KV
            self.handoffs.take_offers(budget_tokens, want)
            budget_tokens = self._budget_tokens()
            want = self._want()
        if self.role == "decode":  # new requests are the prefill workers'
            if block and not self.inflight and not self.handoffs.busy:
                time.sleep(OFFER_POLL_S)  # idle: look at the offers again shortly
            return
        if want <= 0:
            return
        admission = self.protocol.read_batch(budget_tokens, want, load=len(self.inflight))
        if admission.deliveries:
            self._start_many(admission.deliveries, count=True)
        elif admission.too_large is None and block and not self.inflight:
            self._wait_for_work()
        # else: the next request is left in its stream for a worker with room

    def _budget_tokens(self) -> int:
        """Free KV tokens less the room promised to streams being fetched and to requests
        waiting for their prefix from a peer."""
        return (self.engine.admissible_tokens() - self.handoffs.reserved_tokens()
                - self.peers.reserved_tokens())

    def _want(self) -> int:
        """Streams to take now: no read-ahead beyond the running group or the room at the pace
        (-1: none promised); a request left in its stream may go to a worker with room sooner."""
        want, room = self.settings.max_running - len(self.inflight), self.engine.pace_report().room
        return (min(want, room if room >= 0 else want) - len(self.handoffs.incoming)
                - self.peers.num_waiting)

    def _wait_for_work(self) -> None:
        """Idle: block briefly (below the socket timeout) until a request arrives in this
        worker's own interactive stream or a shard's."""
        # One blocking read over all of them on a single Redis; on a cluster each blocks for a
        # share of the wait (a blocking read spans one slot). The batch streams are looked at
        # without waiting; the wait stays short so cancels and orphans stay timely.
        deliveries = []
        reads = self.protocol.blocking_reads()
        block_ms = max(1, self.settings.read_block_ms // len(reads))
        for streams in reads:
            if deliveries := self.protocol.read_new_any(streams, block_ms):
                break
        else:
            for stream in self.protocol.idle_streams():
                if deliveries := self.protocol.read_new_any([stream], None):
                    break
        # The pool is idle: whatever fits at all fits now (one blocking read over several
        # streams may bring one entry of each; a second that does not fit waits in the engine).
        if deliveries:
            self._start_many(deliveries, count=True)

    def _claim_orphans(self) -> None:
        """Resume requests of workers whose heartbeat expired (their entries idle past the TTL)."""
        min_idle_ms = int(self.settings.heartbeat_ttl_s * 1000)
        # The worker holding most of a request's prompt resumes it; the others a little later.
        prefer = ResumePreference(self.settings.resume_prefer_ms, self.engine_block_size(),
                                  self.prefix_root, self.engine.num_cached_prefix_blocks) \
            if self.affinity else None
        while self.engine.can_admit(self.engine_block_size()):
            held = self.inflight.held_ids()
            delivery = self.protocol.claim_orphan(min_idle_ms, held, prefer, self.numerics)
            if delivery is None:
                return
            log.warning("took over %s from a worker whose heartbeat is gone (delivery %d)",
                        delivery.request.req_id, delivery.times_delivered)
            self.metrics.takeover()
            self._start(delivery)

    def engine_block_size(self) -> int:
        return self.engine.config.cache.block_size

    def _start(self, delivery: Delivery) -> None:
        self._start_many([delivery])

    def _start_many(self, deliveries: list[Delivery], count: bool = False) -> None:
        """Fence a new attempt of each delivered request (one round trip for all) and add it to
        the engine; a second entry of a request already served here is only acknowledged.
        `count`: new deliveries, counted in the admission metrics."""
        if count:
            protocol = self.protocol
            self.metrics.deliveries_taken(deliveries, protocol.from_home if protocol.uses_homes
                                          else None)
        fresh: dict[str, Delivery] = {}
        for delivery in deliveries:
            req_id = delivery.request.req_id
            known = (self.inflight[req_id].delivery if req_id in self.inflight
                     else fresh.get(req_id) or self.peers.waiting_delivery(req_id))
            if known is not None:
                if known.entry_id != delivery.entry_id:
                    self.protocol.ack(delivery.stream, delivery.entry_id)
                continue
            fresh[req_id] = delivery
            self.inflight.hold(delivery)  # refreshed from now on, whatever the next step costs
        if not fresh:
            return
        self.timelines.pulled(list(fresh.values()))
        try:
            started = self.protocol.start_attempts(list(fresh))
        except BaseException:
            # not started here: no longer held, so once idle this worker claims them back
            # (`claim_orphan`: its own entries that it does not hold)
            for delivery in fresh.values():
                self._release(delivery)
            raise
        for delivery, attempt in zip(fresh.values(), started):
            self._begin(delivery, attempt)

    def _begin(self, delivery: Delivery, started: Started | None) -> None:
        request = delivery.request
        req_id = request.req_id
        if started is None:  # finished by a worker that died before its XACK
            self.protocol.ack(delivery.stream, delivery.entry_id)
            self._release(delivery)
            return
        attempt, checkpoint = started.attempt, started.checkpoint
        seq = len(checkpoint)
        if delivery.times_delivered > self.settings.max_deliveries:
            log.error("request %s delivered %d times: dead-lettered", req_id,
                      delivery.times_delivered)
            self.protocol.fail(delivery, attempt, seq, f"request failed on "
                               f"{delivery.times_delivered - 1} workers; moved to the dead-letter "
                               f"stream", dead_letter=True)
            self._release(delivery)
            return
        if request.deadline is not None and time.time() > request.deadline:
            self.protocol.fail(delivery, attempt, seq, "request deadline passed before a worker "
                               "could start it")
            self._release(delivery)
            return
        if not self.peers.hold(delivery, started):  # else in once its prefix is fetched
            self._enter(delivery, started)

    def _enter(self, delivery: Delivery, started: Started) -> None:
        """Add a started request to the engine and serve it from here on."""
        request = delivery.request
        req_id, attempt, checkpoint = request.req_id, started.attempt, started.checkpoint
        seq = len(checkpoint)
        try:
            self.engine.add_request(req_id, request.prompt_token_ids, self._params_of(request),
                                    output_token_ids=checkpoint or None,
                                    arrival=request.created or None, **self._adapter_of(request))
        except ValueError as exc:  # a bad adapter too (LoraLoadError): the request's error
            self.protocol.fail(delivery, attempt, seq, str(exc))
            self._release(delivery)
            self.metrics.request_finished("error")
            return
        self._inflight_started(delivery, started)
        if request.lora:
            self.metrics.lora_request_started(request.lora)
        # Queue wait only for a first delivery: a resumed request's wait is not queueing.
        first = delivery.times_delivered == 1 and request.created > 0
        self.metrics.request_started(time.time() - request.created if first else None)

    def _inflight_started(self, delivery: Delivery, started: Started) -> None:
        """Serve a started stream from here on; one continued on other numerics than its tokens
        so far were computed on is counted (its final event says so: `numerics`)."""
        self.inflight.put(delivery.request.req_id, Inflight(
            delivery, started.attempt, len(started.checkpoint), started.numerics))
        self.timelines.started(delivery, len(started.checkpoint))
        if started.other_numerics:
            log.warning("%s continues on other numerics than its first %d tokens (%s)",
                        delivery.request.req_id, len(started.checkpoint), started.numerics)
            self.metrics.resumes_other_numerics.inc()

    def _params_of(self, request):
        """Its sampling parameters; a `batch` request naming no pace gets --batch-target-itl-ms."""
        if request.priority != "batch" or request.params.target_itl_ms is not None:
            return request.params
        return replace(request.params, target_itl_ms=self.settings.batch_target_itl_ms)

    def _adapter_of(self, request) -> dict:
        """add_request's `lora` for a request under an adapter (its blocks hash from the
        adapter's root, as the router hashes its prompt); nothing for the base model."""
        if not request.lora:
            return {}
        return {"lora": LoraRequest(request.lora, request.lora_path,
                                    lora_root(self.protocol.model, request.lora,
                                              request.lora_path))}

    # ---- handoffs and the drain (worker/handoff/coordinator.py calls these) ---------------

    def flush(self, req_id: str) -> None:
        """Publish what a request's events hold back (and any backlog) now: its checkpoint then
        holds every token it generated here."""
        held = self.coalescer.take(req_id)
        self._publish_items([held] if held is not None else [])

    def stream_left(self, inflight: Inflight) -> None:
        """A stream handed to a peer that fenced it: this worker no longer refreshes its entry."""
        self.coalescer.forget(inflight.delivery.request.req_id)
        self._release(inflight.delivery)

    def give_back(self, inflight: Inflight) -> None:
        """Leave a request (out of the engine) to checkpoint resume on another worker, at its
        next orphan check."""
        try:
            self.flush(inflight.delivery.request.req_id)
        except REDIS_FAILURES:
            pass  # its new owner generates those tokens again (the same ones)
        self.stream_left(inflight)
        try:
            self.handoffs.redis.give_back(inflight.delivery.stream, inflight.delivery.entry_id)
        except REDIS_FAILURES as exc:  # it resumes once this worker's heartbeat is gone
            log.warning("could not hand back %s (%r)", inflight.delivery.request.req_id, exc)

    def resume(self, delivery: Delivery, started: Started) -> None:
        """A handed-off stream fenced here whose KV could not be used: resume it from its
        checkpoint, as a claimer would."""
        self.inflight.hold(delivery)
        checkpoint = started.checkpoint
        try:
            self.engine.add_request(delivery.request.req_id, delivery.request.prompt_token_ids,
                                    self._params_of(delivery.request),
                                    output_token_ids=checkpoint or None,
                                    **self._adapter_of(delivery.request))
        except ValueError as exc:
            self.protocol.fail(delivery, started.attempt, len(checkpoint), str(exc))
            self._release(delivery)
            self.metrics.request_finished("error")
            return
        self._inflight_started(delivery, started)
        self.metrics.request_started(None)

    def adopt(self, delivery: Delivery, started: Started) -> None:
        """A handed-off stream now in the engine with its KV: serve it from here on."""
        self.inflight.hold(delivery)
        self._inflight_started(delivery, started)
        if delivery.request.lora:
            self.metrics.lora_request_started(delivery.request.lora)
        self.metrics.request_started(None)

    # ---- publishing ------------------------------------------------------------------------

    def _publish_outputs(self, outputs: list[RequestOutput]) -> None:
        items, left = [], []
        for output in outputs:
            inflight = self.inflight.get(output.req_id)
            if inflight is None or (not output.new_token_ids and output.finish_reason is None):
                continue
            items.append(self._publication(output, inflight))
            if inflight.delivery.request.lora:
                self.metrics.lora_output_tokens(inflight.delivery.request.lora,
                                                len(output.new_token_ids))
            inflight.num_output_tokens = output.num_output_tokens
            if output.finish_reason is not None:
                self.inflight.pop(output.req_id)
                left.append(output.req_id)
        self._publish_items(self.coalescer.step(items))
        if left:
            self.handoffs.forget(left)

    def _publication(self, output: RequestOutput, inflight: Inflight) -> Publication:
        final = output.finish_reason is not None
        event = TokenEvent(
            seq=output.num_output_tokens - len(output.new_token_ids),
            attempt=inflight.attempt,
            token_ids=list(output.new_token_ids),
            logprobs=output.new_logprobs,
            prompt_logprobs=output.prompt_logprobs,
            finish_reason=output.finish_reason,
            usage=Usage(output.num_prompt_tokens, output.num_output_tokens,
                        output.num_cached_tokens) if final else None,
            error=(output.error or "the worker failed") if output.finish_reason == "error" else None,
            stop_reason=output.stop.reason if output.stop else None,
            text_after_stop=output.stop.text_after if output.stop else None,
            numerics=(inflight.numerics or None) if final else None)
        status = RequestStatus.for_finish_reason(output.finish_reason) if final else None
        return Publication(output.req_id, inflight.attempt, event, status,
                           inflight.delivery.stream, inflight.delivery.entry_id,
                           inflight.delivery.request.reply_to)

    def _publish_items(self, items: list[Publication]) -> None:
        pending = self._backlog + items
        self._backlog = pending  # kept until Redis has taken them
        accepted = self.protocol.publish(pending)
        self._backlog = []
        self._record_timelines(pending, accepted)
        self.metrics.events_published(sum(accepted))
        for item, ok in zip(pending, accepted):
            if item.final_status is not None or not ok:  # acked, or no longer ours
                self.inflight.release_entry(item.stream, item.entry_id)
            if not ok and item.req_id in self.inflight:
                # Fenced: another worker owns a newer attempt; stop generating at once.
                log.warning("attempt %d of %s is stale; stopping it", item.attempt, item.req_id)
                self.engine.abort(item.req_id)
                self.coalescer.forget(item.req_id)
                self.inflight.pop(item.req_id)
                self.timelines.forget(item.req_id)
                self.handoffs.forget([item.req_id])
                self.metrics.request_finished("abort")

    # ---- heartbeat -------------------------------------------------------------------------

    def _release(self, delivery: Delivery) -> None:
        self.timelines.forget(delivery.request.req_id)  # it ends here without a timeline
        self.inflight.release(delivery)

    def _record_timelines(self, items: list[Publication], accepted: list[bool]) -> None:
        ended = self.timelines.published(items, accepted)
        try:
            self.protocol.record_timelines(ended, self.settings.timelines_kept)
        except REDIS_FAILURES as exc:  # a diagnostic: never worth holding an answer back for
            log.debug("timelines not recorded (%r)", exc)
