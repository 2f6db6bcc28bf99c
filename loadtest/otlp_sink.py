"""A minimal OTLP/gRPC trace receiver that counts spans and drops them: a stand-in collector,
so a load test with tracing on pays the full export cost without a real backend.

    python loadtest/otlp_sink.py --port 4317      # prints "spans N" on SIGTERM/SIGINT
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args()
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"otlp sink on 127.0.0.1:{args.port}", flush=True)
    done.wait()
    server.stop(1)
    print(f"spans {sink.spans}", flush=True)


if __name__ == "__main__":
    main()
