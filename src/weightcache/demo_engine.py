"""The demo's engine: one restart of an engine, timed from its start of loading to its
first output.

Run by `weightcache demo` as a fresh process per restart. It imports what it needs
(torch, transformers and the model's modeling module: the same for every path, timed
apart as `imports_ms`). Then the clock starts: a ready model through
weightcache.integrations.transformers.from_pretrained, from the cache (`--source
cache`: attach, fallback=error) or from disk (`--source disk`: safetensors load_file of
every shard, then the same bind), and one forward pass: the first output, where a
restart ends.

The weights phase is the part of that which depends on where the weights come from:
get them, bind them, and have every byte resident in the engine. A lazily mapped file
(load_file on the CPU) is read only when touched, so each page of every tensor is read
once before the forward pass (what that pass would otherwise fault in, and for a cold
file read from disk). Building the model on the meta device and the forward pass are
outside it; they are in the restart.

Prints a JSON line once its imports are done, waits for "go" on stdin (so the demo can
start every engine's imports at once, and still time one load at a time, alone), then
prints its result as one JSON line. With --hold it then keeps the model (and its
attachment) until stdin closes, so the demo can measure several engines alive at once.

With --check-transformers (the packaged MiniLM) it also loads the model with
transformers' own from_pretrained and says whether the outputs are bit-identical.
"""

import argparse
import hashlib
import json
import os
import sys
import time

START = time.perf_counter()  # before the heavy imports: the process's own start-up is timed apart

SENTENCES = ["A restarting engine maps its weights instead of reading them.",
             "Weights stay resident on the node while engines come and go."]
PROMPT_TOKENS = [1, 306, 4091, 29871]  # a fixed 4-token prompt for the generated Llama (no tokenizer)


def digest(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--source", required=True, choices=["cache", "disk"])
    parser.add_argument("--model-class", default="AutoModelForCausalLM", help="a transformers Auto class")
    parser.add_argument("--socket-dir")
    parser.add_argument("--cache")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU backends")
    parser.add_argument("--hold", action="store_true", help="keep the model until stdin closes")
    parser.add_argument("--check-transformers", action="store_true",
                        help="also load with transformers' from_pretrained and compare the outputs")
    args = parser.parse_args()

    import torch
    import transformers
    from accelerate import init_empty_weights

    from weightcache.integrations.transformers import from_pretrained

    model_class = getattr(transformers, args.model_class)
    inputs = _inputs(args.model)
    with init_empty_weights(include_buffers=False):  # transformers' lazy modules, imported: not timed
        model_class.from_config(transformers.AutoConfig.from_pretrained(args.model))
    if args.device != "cpu":
        torch.empty(1, device=args.device)  # an engine has its CUDA context before it asks for weights
    imports_ms = (time.perf_counter() - START) * 1e3
    print(json.dumps({"ready": True, "pid": os.getpid(), "imports_ms": imports_ms}), flush=True)
    if sys.stdin.readline().strip() != "go":  # the demo says when: one engine loads at a time
        return 0

    overrides = ({"mode": "client", "fallback": "error", "socket_dir": args.socket_dir, "cache_name": args.cache}
                 if args.source == "cache" else {"mode": "off"})
    phases = {}
    start = time.perf_counter()
    model, weights = from_pretrained(args.model, model_class, device=args.device, report_file="", phases_ms=phases,
                                     **overrides)
    loaded_ms = (time.perf_counter() - start) * 1e3
    touched = time.perf_counter()
    touch(weights.tensors)
    phases["resident"] = (time.perf_counter() - touched) * 1e3
    output = _forward(model, inputs, args.device)
    first_output_ms = (time.perf_counter() - start) * 1e3
    # The weights phase: get them, bind them, have every byte resident. Building the
    # model on the meta device (the same for every path) and the forward pass are not in it.
    weights_ms = phases["weights"] + phases["bind"] + phases["resident"]

    result = {"pid": os.getpid(), "source": weights.source, "reason": weights.reason, "device": args.device,
              "imports_ms": imports_ms, "loaded_ms": loaded_ms, "weights_ms": weights_ms,
              "first_output_ms": first_output_ms, "phases_ms": phases,
              "attach_ms": weights.attached.attach_ms if weights.attached else None,
              "resident_bytes": weights.resident_bytes, "output_sha256": digest(output),
              "output_shape": list(output.shape)}
    if args.check_transformers:
        reference = model_class.from_pretrained(args.model).eval()
        result["transformers_identical"] = bool(torch.equal(output, _forward(reference, inputs, "cpu")))
    print(json.dumps(result), flush=True)
    if args.hold:
        sys.stdin.read()  # until the demo closes our stdin
    if weights.attached is not None:
        weights.attached.close()
    return 0


def touch(tensors: dict) -> None:
    """Read one byte of every page of every CPU tensor: what the first forward pass
    would fault in (and, for a lazily mapped file, read from disk), done up front so the
    weights phase ends with every weight byte resident in this process. GPU tensors are
    resident by construction."""
    import torch

    seen = set()
    for tensor in tensors.values():
        if tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        int(flat[::4096].sum()) + int(flat[-1])


def _inputs(model_dir) -> dict:
    import pathlib

    import torch

    if (pathlib.Path(model_dir) / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return dict(AutoTokenizer.from_pretrained(model_dir)(SENTENCES, padding=True, return_tensors="pt"))
    return {"input_ids": torch.tensor([PROMPT_TOKENS])}


def _forward(model, inputs: dict, device: str):
    import torch

    with torch.inference_mode():
        out = model(**{k: v.to(device) for k, v in inputs.items()})
        tensor = out.logits if hasattr(out, "logits") else out.last_hidden_state
        return tensor.float().cpu()


if __name__ == "__main__":
    raise SystemExit(main())
