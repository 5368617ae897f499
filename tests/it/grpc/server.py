"""A gRPC upstream with Python's grpcio, speaking HTTP/2 in plain text
(h2c) on 127.0.0.1, port chosen by the system and printed on the first
line. Methods of `bank.Ledger`, bytes in and out (no protobuf):

- `Debit` (unary): applies the request; answers `applied <body>`.
- `Deposit` (client streaming): applies the concatenated messages once
  the stream ends; answers `applied <bodies>`.
- `Applied` (unary): every write applied so far, one per line, as
  `<x-fence-token> <body>`, in the order applied.

A write carrying `x-test-delay-ms` is held that long before it is applied.
"""
import sys
import threading
import time
from concurrent import futures

import grpc

applied = []
lock = threading.Lock()


def apply(context, body):
    md = dict(context.invocation_metadata())
    delay = int(md.get("x-test-delay-ms", "0"))
    if delay:
        time.sleep(delay / 1000)
    with lock:
        applied.append(f"{md.get('x-fence-token', '-')} {body}")
    return f"applied {body}".encode()


def debit(request, context):
    return apply(context, request.decode())


def deposit(requests, context):
    return apply(context, "".join(r.decode() for r in requests))


def listed(request, context):
    with lock:
        return "\n".join(applied).encode()


handlers = grpc.method_handlers_generic_handler(
    "bank.Ledger",
    {
        "Debit": grpc.unary_unary_rpc_method_handler(debit),
        "Deposit": grpc.stream_unary_rpc_method_handler(deposit),
        "Applied": grpc.unary_unary_rpc_method_handler(listed),
    },
)
server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
server.add_generic_rpc_handlers((handlers,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
# Ends with the test: stdin closes when the test drops the process.
sys.stdin.read()
server.stop(0)
