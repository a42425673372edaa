"""Element types on the wire: safetensors' names, their sizes and torch's types.

Both the daemon (validating headers, planning slabs) and the client (building views)
read this one table.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # as in safetensors headers and TensorTable.dtype
    itemsize: int
    torch_name: str  # attribute of the torch module


_TABLE = [
    DType("F64", 8, "float64"),
    DType("F32", 4, "float32"),
    DType("F16", 2, "float16"),
    DType("BF16", 2, "bfloat16"),
    DType("I64", 8, "int64"),
    DType("I32", 4, "int32"),
    DType("I16", 2, "int16"),
    DType("I8", 1, "int8"),
    DType("U64", 8, "uint64"),
    DType("U32", 4, "uint32"),
    DType("U16", 2, "uint16"),
    DType("U8", 1, "uint8"),
    DType("BOOL", 1, "bool"),
    DType("F8_E4M3", 1, "float8_e4m3fn"),
    DType("F8_E5M2", 1, "float8_e5m2"),
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}


def torch_dtype(name: str):
    """The torch dtype for a safetensors dtype name."""
    import torch

    return getattr(torch, DTYPES[name].torch_name)


def wire_name(dtype) -> str:
    """The safetensors name of a torch dtype."""
    torch_name = str(dtype).removeprefix("torch.")
    for d in _TABLE:
        if d.torch_name == torch_name:
            return d.name
    raise ValueError(f"torch dtype {dtype} has no safetensors name")
