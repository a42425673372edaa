"""A minimal engine process for the tests.

Gets its weights through weightcache.client.load_weights (settings from WEIGHTCACHE_*
variables, as the webhook will set them), prints one JSON line, then answers one
command per stdin line with one JSON line:
  checksum       sha256 over every tensor's name and bytes
  write NAME     write into tensor NAME in place (on attached weights this must fail)
  exit           leave
"""

import hashlib
import json
import os
import sys


def checksum(tensors) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    import torch

    from weightcache.client import load_weights

    weights = load_weights(sys.argv[1])
    reply = {"pid": os.getpid(), "source": weights.source, "reason": weights.reason, "tensors": len(weights.tensors),
             "bytes": weights.resident_bytes, "checksum": checksum(weights.tensors)}
    print(json.dumps(reply), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "checksum":
            reply = {"checksum": checksum(weights.tensors)}
        elif command == "write":
            tensor = weights.tensors[arg]
            tensor.view(-1)[0] = 1  # read-only: SIGSEGV on cpu, an illegal-address error on the GPU
            if tensor.is_cuda:
                torch.cuda.synchronize()
            reply = {"wrote": arg}
        elif command == "exit":
            return 0
        else:
            reply = {"error": f"unknown command {command!r}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
