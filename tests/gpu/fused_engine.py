"""A test engine with a layout of its own, as vLLM has: fused q/k/v and gate/up
projections and a padded vocabulary, built from seeded random weights on the GPU.
It publishes into a cuda-vmm store or attaches to what was published, runs a small
forward pass and prints one JSON object (the outputs' sha256, which path it took).

    python fused_engine.py publish MODEL_DIR SOCKET_DIR CACHE GIB
    python fused_engine.py attach  MODEL_DIR SOCKET_DIR CACHE GIB
    python fused_engine.py stall   MODEL_DIR SOCKET_DIR CACHE GIB   # fills half, then waits to be killed
"""

import hashlib
import json
import os
import sys
import time

import torch
from weightcache.client import attach, fingerprint, publish
from weightcache.client import wire_pb2 as wire
from weightcache.client.attach import request
from weightcache.client.gpu import import_mapping, split
from weightcache.client.load import resolve_device
from weightcache.client.mapping import build_views
from weightcache.client.protocol import PROTOCOL_VERSION
from weightcache.client.publish import declare, store_sockets

HIDDEN, VOCAB, PADDED_VOCAB = 1024, 1000, 1024


def layer_count(gib: float) -> int:
    per_layer = (3 * HIDDEN * HIDDEN + 2 * 4 * HIDDEN * HIDDEN + 4 * HIDDEN * HIDDEN) * 2
    return max(1, int(gib * 2**30 // per_layer))


def fused_tensors(gib: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(7)

    def rand(*shape):
        return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)

    tensors = {"embed_tokens.weight": rand(PADDED_VOCAB, HIDDEN)}
    for i in range(layer_count(gib)):
        tensors[f"layers.{i}.qkv_proj.weight"] = rand(3 * HIDDEN, HIDDEN)
        tensors[f"layers.{i}.gate_up_proj.weight"] = rand(2 * 4 * HIDDEN, HIDDEN)
        tensors[f"layers.{i}.down_proj.weight"] = rand(HIDDEN, 4 * HIDDEN)
    return tensors


def forward(tensors: dict) -> str:
    x = tensors["embed_tokens.weight"][torch.arange(8, device="cuda") * 97 % VOCAB]
    i = 0
    while f"layers.{i}.qkv_proj.weight" in tensors:
        q, k, v = (x @ tensors[f"layers.{i}.qkv_proj.weight"].T).chunk(3, dim=-1)
        x = x + torch.softmax(q @ k.T / HIDDEN**0.5, dim=-1) @ v
        gate, up = (x @ tensors[f"layers.{i}.gate_up_proj.weight"].T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ tensors[f"layers.{i}.down_proj.weight"].T
        x = x / x.float().norm(dim=-1, keepdim=True).to(x.dtype)
        i += 1
    out = x @ tensors["embed_tokens.weight"].T
    torch.cuda.synchronize()
    return hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()


def expected_fingerprint(model_dir: str, device: str) -> "wire.Fingerprint":
    from weightcache.client.gpu import fingerprint_device

    return fingerprint.for_engine(model_dir, engine="fused-test-engine", engine_version="1", dtype="bfloat16",
                                  settings={"hidden": HIDDEN, "padded_vocab": PADDED_VOCAB},
                                  device=fingerprint_device(device))


def main() -> int:
    mode, model_dir, socket_dir, cache, gib = sys.argv[1:6]
    gib = float(gib)
    torch.empty(1, device="cuda")  # the engine's CUDA context exists before it loads (not timed)
    device = resolve_device("cuda")
    expected = expected_fingerprint(model_dir, device)
    where = dict(socket_dir=socket_dir, cache_name=cache, device=device)
    if mode == "attach":
        start = time.perf_counter()
        att = attach(expected=expected, **where)
        ms = (time.perf_counter() - start) * 1e3
        print(json.dumps({"source": "cache", "attach_ms": ms, "phases_ms": att.phases_ms, "output": forward(att.tensors),
                          "tensors": len(att.tensors), "bytes": att.resident_bytes}), flush=True)
        sys.stdin.read()  # hold the attachment until told to go (stdin closed)
        return 0
    private = fused_tensors(gib)
    torch.cuda.synchronize()
    if mode == "stall":
        stall(private, expected, where)
        return 1
    own = forward(private)
    start = time.perf_counter()
    att, wrote = publish(private, expected, **where)
    ms = (time.perf_counter() - start) * 1e3
    del private
    torch.cuda.empty_cache()
    print(json.dumps({"source": "published" if wrote else "cache", "publish_ms": ms, "phases_ms": att.phases_ms,
                      "own_output": own, "output": forward(att.tensors), "tensors": len(att.tensors),
                      "bytes": att.resident_bytes}), flush=True)
    return 0


def stall(private: dict, expected, where) -> None:
    """Receive writable slabs, fill half of the tensors, say so, and wait to be killed."""
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name="stalling-writer")
    req.publish.fingerprint.CopyFrom(expected)
    req.publish.tensors.CopyFrom(declare(private))
    path = store_sockets(where["socket_dir"], where["cache_name"], where["device"])[0]
    sock, response, fds = request(path, req, 30, accept_fds=True)
    layout = response.writable.layout
    sizes = [s.size for s in layout.slabs]
    mapping = import_mapping(fds, sizes, where["device"], read_only=False)
    views = build_views(layout, split(mapping.tensor(), sizes))
    for name in sorted(views)[: len(views) // 2]:
        views[name].copy_(private[name])
    torch.cuda.synchronize()
    print(json.dumps({"filling": True, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    sock.close()


if __name__ == "__main__":
    raise SystemExit(main())
