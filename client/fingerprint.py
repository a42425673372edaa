"""The fingerprint: everything that must agree before an engine may use cached bytes.

Client and daemon compute it with the same function from the same inputs; the daemon
compares the engine's expected fingerprint with its own field by field, so a mismatch
names exactly what differs (see DESIGN.md, Safety contract).
"""

import hashlib
import json
import pathlib
from dataclasses import dataclass

from . import wire_pb2 as wire
from .modelfiles import CONFIG_FILE, opened
from .protocol import LAYOUT_VERSION


@dataclass(frozen=True)
class Parallelism:
    """Which slice of the model this cache or engine holds."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self):
        for kind in ("tp", "pp", "dp"):
            size, rank = getattr(self, f"{kind}_size"), getattr(self, f"{kind}_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{kind} rank {rank} is outside 0..{size - 1} for {kind} size {size}")


@dataclass(frozen=True)
class Device:
    """What the fingerprint records of the device the bytes live on."""

    kind: str = "cpu"  # "cpu" or "cuda"
    compute_capability: str = ""
    driver_version: str = ""


def quantization_of(config: dict) -> tuple[str, str]:
    """(label, hash of the quantization config) for a model config.

    Labels: "none"; "fp8-block" for block-wise FP8 (weight_block_size present);
    "fp8" for per-tensor FP8; otherwise the checkpoint's own quant_method
    ("awq", "gptq", "bitsandbytes", ...), lower-cased. The daemon decides which labels
    it serves; this function only names what the checkpoint is.
    """
    qc = config.get("quantization_config")
    if qc is None:
        return "none", ""
    if not isinstance(qc, dict):
        return "malformed-quantization-config", _hash_json(qc)
    method = str(qc.get("quant_method") or qc.get("quantization_method") or "unknown").lower()
    if qc.get("load_in_4bit") or qc.get("load_in_8bit"):
        method = "bitsandbytes"
    if method == "fp8" and qc.get("weight_block_size"):
        method = "fp8-block"
    return method, _hash_json(qc)


def _hash_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_hash(model) -> str:
    """sha256 over config.json and every safetensors header: the model's identity.

    Headers carry every tensor's name, dtype, shape and offsets, so two checkpoints
    that hash alike hold the same tensors in the same places; reading them costs
    kilobytes, not the gigabytes of data. MODEL: a model directory, or its open
    ModelFiles (the daemon hashes the very files it loaded).
    """
    h = hashlib.sha256()
    with opened(model) as files:
        h.update(b"config.json\0")
        h.update(files.read(CONFIG_FILE))
        names, _ = files.shards()
        for name in names:
            h.update(b"\0" + name.encode() + b"\0")
            h.update(files.raw_header(name))
    return h.hexdigest()


def compute(model, *, revision: str = "", parallel: Parallelism = Parallelism(),
            device: Device = Device()) -> "wire.Fingerprint":
    """The fingerprint of MODEL (a model directory or its open ModelFiles)."""
    import torch

    with opened(model) as files:
        config = files.config()
        identity = model_hash(files)
    quantization, quantization_hash = quantization_of(config)
    dtype = config.get("torch_dtype") or config.get("dtype") or ""
    return wire.Fingerprint(
        model_hash=identity,
        revision=revision,
        tp_size=parallel.tp_size, tp_rank=parallel.tp_rank,
        pp_size=parallel.pp_size, pp_rank=parallel.pp_rank,
        dp_size=parallel.dp_size, dp_rank=parallel.dp_rank,
        quantization=quantization,
        quantization_config_hash=quantization_hash,
        dtype=str(dtype),
        device_kind=device.kind,
        compute_capability=device.compute_capability,
        driver_version=device.driver_version,
        torch_version=torch.__version__,
        layout_version=LAYOUT_VERSION,
    )


def for_engine(model_dir: pathlib.Path, *, engine: str, engine_version: str, dtype: str, settings: dict,
               revision: str = "", parallel: Parallelism = Parallelism(),
               device: Device = Device()) -> "wire.Fingerprint":
    """The fingerprint of a cache an engine publishes in its own layout: the checkpoint's
    identity, parallelism and device as for a loaded cache, plus the engine, its version,
    the dtype its tensors have, and a hash of every other engine setting that changes
    them (SETTINGS: JSON-able). Settings that leave the tensors alone (port, context
    length, memory use) do not belong in SETTINGS."""
    if not engine:
        raise ValueError("a published cache must name its engine")
    fingerprint = compute(model_dir, revision=revision, parallel=parallel, device=device)
    fingerprint.dtype = dtype
    fingerprint.engine = engine
    fingerprint.engine_version = engine_version
    fingerprint.engine_settings_hash = _hash_json(settings)
    return fingerprint


def fields(fp: "wire.Fingerprint") -> dict[str, object]:
    """Every field, defaults included, in declaration order."""
    return {f.name: getattr(fp, f.name) for f in fp.DESCRIPTOR.fields}


def digest(fp: "wire.Fingerprint") -> str:
    """A stable hex digest of every field (names sockets and status)."""
    return _hash_json(fields(fp))


def differences(expected: "wire.Fingerprint", actual: "wire.Fingerprint") -> list[tuple[str, str, str]]:
    """(field, expected, actual) for each field that differs."""
    mine, theirs = fields(expected), fields(actual)
    return [(name, str(mine[name]), str(theirs[name])) for name in mine if mine[name] != theirs[name]]
