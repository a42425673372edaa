"""A writer or reader process for the publishing tests (tests/integration/test_publish.py).

Prints one JSON line once it has done its part, then holds what it got (an attachment,
writable slabs) until its stdin closes, and exits 0. With PUBLISHER_RELEASE_FD set it
first gets ready (torch imported, inputs made), prints {"ready": true} and acts only at
that pipe's EOF: so that a process can start while another one still works, and several
can be let go at once.

  publish MODEL SOCKET_DIR CACHE SEED CASE
      weightcache.client.publish of tensors(SEED): {"pid", "wrote", "checksum"}.
  attach MODEL SOCKET_DIR CACHE CASE
      weightcache.client.attach: {"pid", "checksum"}.
  engine MODEL SEED
      attach_or_publish by the WEIGHTCACHE_* variables: {"pid", "source", "reason", "checksum"}.
  hold-writable SOCKET REQUEST_HEX
      A writer that dies mid-write, without torch: sends the publish request, takes its
      writable slabs, writes 0xAB over the first half of slab 0 and keeps them:
      {"pid", "slabs", "written"}.
"""

import hashlib
import json
import os
import socket
import sys

ENGINE = "testengine"
ENGINE_VERSION = "1.0"
# An engine's own layout: fused and padded tensors of several dtypes, a scalar, an empty one.
TENSOR_SPECS = {
    "qkv_proj.weight": ("bfloat16", (24, 8)),
    "gate_up_proj.weight": ("float32", (16, 8)),
    "embed_tokens.weight": ("float16", (50, 8)),
    "norm.weight": ("float32", (8,)),
    "positions": ("int64", (5,)),
    "mask": ("bool", (3, 3)),
    "scale": ("float32", ()),
    "empty": ("float32", (0, 4)),
}


def tensors(seed: int) -> dict:
    """The engine's tensors, the same for the same seed in every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (dtype_name, shape) in TENSOR_SPECS.items():
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            out[name] = torch.randint(0, 2, shape, generator=g).bool()
        else:
            out[name] = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return out


def checksum(named: dict) -> str:
    """sha256 over every tensor's name and bytes."""
    import torch

    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(model_dir, *, dtype: str = "bfloat16", case: str = "default", engine: str = ENGINE):
    from weightcache.client.fingerprint import for_engine

    return for_engine(model_dir, engine=engine, engine_version=ENGINE_VERSION, dtype=dtype, settings={"case": case})


def say(**fields) -> None:
    print(json.dumps({"pid": os.getpid(), **fields}), flush=True)


def released() -> None:
    """Wait for PUBLISHER_RELEASE_FD's EOF, if set (see the module's docstring)."""
    fd = os.environ.get("PUBLISHER_RELEASE_FD")
    if fd:
        say(ready=True)
        os.read(int(fd), 1)


def publish(model, socket_dir, cache, seed, case):
    from weightcache.client import publish as publish_tensors

    expected, mine = fingerprint(model, case=case), tensors(int(seed))
    released()
    attached, wrote = publish_tensors(mine, expected, socket_dir=socket_dir, cache_name=cache, timeout=60)
    say(wrote=wrote, checksum=checksum(attached.tensors))
    return attached


def attach(model, socket_dir, cache, case):
    from weightcache.client import attach as attach_to

    expected = fingerprint(model, case=case)
    released()
    attached = attach_to(expected=expected, socket_dir=socket_dir, cache_name=cache, timeout=60)
    say(checksum=checksum(attached.tensors))
    return attached


def engine(model, seed):
    from weightcache.client import attach_or_publish

    expected = fingerprint(model)
    released()
    loaded = attach_or_publish(expected, load=lambda: tensors(int(seed)), model_dir=model)
    say(source=loaded.source, reason=loaded.reason, checksum=checksum(loaded.tensors))
    return loaded


def hold_writable(path, request_hex):
    from weightcache.client import wire_pb2 as wire
    from weightcache.client.protocol import MAX_RESPONSE_BYTES, recv_message

    released()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(bytes.fromhex(request_hex))
    response, fds = recv_message(sock, wire.Response, max_bytes=MAX_RESPONSE_BYTES, timeout=60, accept_fds=True)
    assert response.WhichOneof("kind") == "writable", response
    sizes = [slab.size for slab in response.writable.layout.slabs]
    half = sizes[0] // 2
    os.pwrite(fds[0], b"\xab" * half, 0)
    say(slabs=sizes, written=half)
    return sock, fds


def main() -> int:
    command, args = sys.argv[1], sys.argv[2:]
    held = {"publish": publish, "attach": attach, "engine": engine, "hold-writable": hold_writable}[command](*args)
    sys.stdin.read()  # hold it until the test lets go
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
