"""One gRPC call with Python's grpcio, the way a real gRPC client makes
it: `call.py TARGET METHOD BODY [NAME=VALUE ...]`, each NAME=VALUE sent as
metadata. BODY with `|` in it is a client stream of its parts, a part
`~` a pause of 300 ms in the stream instead of a message. Prints
`OK <answer>` or `<STATUS> <fencegate-problem> <details>`."""
import sys
import time

import grpc


def parts(body):
    for p in body.split("|"):
        if p == "~":
            time.sleep(0.3)
        else:
            yield p.encode()


target, method, body = sys.argv[1:4]
metadata = [tuple(m.split("=", 1)) for m in sys.argv[4:]]
channel = grpc.insecure_channel(target)
try:
    if "|" in body:
        call = channel.stream_unary(method)
        answer = call(parts(body), metadata=metadata, timeout=30)
    else:
        call = channel.unary_unary(method)
        answer = call(body.encode(), metadata=metadata, timeout=30)
    print("OK", answer.decode())
except grpc.RpcError as e:
    trailers = dict(e.trailing_metadata() or [])
    print(e.code().name, trailers.get("fencegate-problem", "-"), e.details())
