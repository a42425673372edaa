"""The demo's engine process: the same model from disk and from the cache, compared.

Run by `weightcache demo` as a fresh process, so attaching happens the way a restarting
engine would do it. Prints one JSON object.
"""

import argparse
import json
import time

SENTENCES = ["A restarting engine maps its weights instead of reading them.",
             "Weights stay resident on the node while engines come and go."]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--cache", required=True)
    args = parser.parse_args()

    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from weightcache.client import attach, bind

    config = AutoConfig.from_pretrained(args.model)
    inputs = AutoTokenizer.from_pretrained(args.model)(SENTENCES, padding=True, return_tensors="pt")
    with init_empty_weights(include_buffers=False):
        AutoModel.from_config(config)  # warm-up: imports and lazy modules, not timed

    start = time.perf_counter()
    from_disk = AutoModel.from_pretrained(args.model).eval()
    disk_ms = (time.perf_counter() - start) * 1e3

    start = time.perf_counter()
    with init_empty_weights(include_buffers=False):
        from_cache = AutoModel.from_config(config)
    attached = attach(args.model, socket_dir=args.socket_dir, cache_name=args.cache, client_name="demo-engine")
    bind(from_cache, attached.tensors)
    from_cache.eval()
    attach_ms = (time.perf_counter() - start) * 1e3

    with torch.inference_mode():
        a = from_disk(**inputs).last_hidden_state
        b = from_cache(**inputs).last_hidden_state
    print(json.dumps({"disk_load_ms": disk_ms, "attach_ms": attach_ms, "outputs_identical": bool(torch.equal(a, b)),
                      "output_shape": list(a.shape)}))
    attached.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
