"""What OpenTelemetry tracing costs a fleet (issue 54: at most 3% of throughput on, nothing off):
`kvfleet up` with `--otlp-traces-endpoint` against the same fleet without it, alternated rounds
(off, on; then on, off; ...), each a fresh fleet serving the chat trace over HTTP with
`kvfleet bench` (every request at once, greedy). The endpoint is an OTLP/HTTP receiver in this
process that accepts every export and counts the spans' bytes, so the cost measured is the
fleet's own (making, batching and sending spans), not a collector's.

    .venv/bin/python -m benchmarks.tracing_cost --rounds 3

Prints each round's output tok/s with tracing off and on, their ratio, the medians, the exports
received, and fails (exit 1) on any failed request or a round whose traced fleet exported
nothing."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from benchmarks.http_peers import WORKLOAD, free_port, kvfleet_server, measure, stop_session
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path


class OtlpSink:
    """An OTLP/HTTP traces receiver that answers every export with success and counts them."""

    def __init__(self):
        sink = self
        self.exports = 0
        self.bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's spelling)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.exports += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def run_fleet(traced: bool, sink: OtlpSink, args, out_dir: Path, round_no: int):
    port = free_port()
    name = f"tracing {'on' if traced else 'off'}, round {round_no}"
    extra = ["--otlp-traces-endpoint", sink.url] if traced else []
    started = time.perf_counter()
    process = kvfleet_server(port, args.dtype, out_dir / f"{name.replace(' ', '_')}.log",
                             model=args.model, extra=extra)
    try:
        exports_before = sink.exports
        result = measure(name, f"http://127.0.0.1:{port}", args.model, process, started, args,
                         out_dir)
        time.sleep(args.flush_s)  # the batch span processor's last export
        return result, sink.exports - exports_before
    finally:
        stop_session(process)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=0)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--flush-s", type=float, default=6.0,
                   help="wait after a traced run for the spans' last export (the SDK's batch "
                        "delay is 5 s)")
    args = p.parse_args(argv)
    resolve_model_path(args.model)
    print(f"CPU: {cpu_features().describe()}", flush=True)
    sink = OtlpSink()
    rows = []
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        for r in range(1, args.rounds + 1):
            order = (False, True) if r % 2 else (True, False)
            got = {}
            for traced in order:
                result, exports = run_fleet(traced, sink, args, out_dir, r)
                got[traced] = result.tokens_per_s
                failed |= result.num_errors > 0 or (traced and exports == 0)
                if traced:
                    print(f"  exports received: {exports}", flush=True)
            rows.append((got[False], got[True]))
    sink.close()
    print("\n| round | off tok/s | on tok/s | on / off |\n|---:|---:|---:|---:|")
    for r, (off, on) in enumerate(rows, 1):
        print(f"| {r} | {off:.1f} | {on:.1f} | {on / off:.3f} |")
    ratios = [on / off for off, on in rows]
    off_median = statistics.median(off for off, _ in rows)
    on_median = statistics.median(on for _, on in rows)
    print(f"\nmedian of the rounds' on/off: {statistics.median(ratios):.3f}; medians' ratio "
          f"{on_median / off_median:.3f} ({on_median:.1f} vs {off_median:.1f} tok/s); "
          f"{sink.exports} exports, {sink.bytes / 1e6:.2f} MB of spans")
    if failed:
        print("FAILED: a request failed, or a traced fleet exported nothing", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
