"""One unary gRPC call with Python's grpcio, the way a real gRPC client
makes it: `call.py TARGET METHOD BODY [NAME=VALUE ...]`, each NAME=VALUE
sent as metadata. Prints `OK <answer>` or
`<STATUS> <fencegate-problem> <details>`."""
import sys

import grpc

target, method, body = sys.argv[1:4]
metadata = [tuple(m.split("=", 1)) for m in sys.argv[4:]]
channel = grpc.insecure_channel(target)
call = channel.unary_unary(method)
try:
    answer = call(body.encode(), metadata=metadata, timeout=10)
    print("OK", answer.decode())
except grpc.RpcError as e:
    trailers = dict(e.trailing_metadata() or [])
    print(e.code().name, trailers.get("fencegate-problem", "-"), e.details())
