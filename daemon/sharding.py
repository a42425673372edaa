"""Tensor-parallel sharding: which slice of each tensor a rank's slabs hold.

A plan maps module-name patterns to styles, as transformers' `base_model_tp_plan`
does ({"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}).
`*` stands for one dotted segment. Patterns match a module path or any suffix of it
after whole segments, so "layers.*.mlp.down_proj" also matches
"model.layers.3.mlp.down_proj". A tensor no pattern matches is replicated.

  colwise  (nn.Linear output features) weight and bias split along dim 0
  rowwise  (nn.Linear input features)  weight split along its last dim; bias replicated

Pure: sources in, sharded sources out. A shard along dim 0 is one contiguous file
range; a shard along the last dim is `rows` equal pieces `pitch` bytes apart, which
the loader copies as a 2-D region.
"""

import json
import pathlib
import re
from dataclasses import dataclass, replace

from weightcache.client.dtypes import DTYPES
from weightcache.client.errors import CheckpointError

from .checkpoint import TensorSource

# Style -> which dim a weight (and a bias) is split along; None replicates.
STYLES = {
    "colwise": (0, 0),
    "colwise_rep": (0, 0),
    "local_colwise": (0, 0),
    "rowwise": (-1, None),
    "rowwise_rep": (-1, None),
    "local_rowwise": (-1, None),
    "replicate": (None, None),
}


@dataclass(frozen=True)
class TpPlan:
    rules: tuple[tuple[re.Pattern, str, str], ...]  # (compiled pattern, pattern text, style)

    @classmethod
    def from_dict(cls, plan: dict, source: str) -> "TpPlan":
        rules = []
        for pattern, style in plan.items():
            if style not in STYLES:
                raise CheckpointError(f"{source}: tensor-parallel style {style!r} for {pattern!r} is not supported "
                                      f"(supported: {', '.join(STYLES)})")
            segments = [r"[^.]+" if s == "*" else re.escape(s) for s in pattern.split(".")]
            rules.append((re.compile(r"(^|.*\.)" + r"\.".join(segments) + r"$"), pattern, style))
        return cls(tuple(rules))

    def style_of(self, module_path: str) -> str | None:
        for regex, _, style in self.rules:
            if regex.match(module_path):
                return style
        return None


def shard_dim(plan: TpPlan, name: str, ndim: int) -> int | None:
    """The dim `name` is split along under `plan` (non-negative), or None to replicate."""
    module, _, leaf = name.rpartition(".")
    style = plan.style_of(module)
    if style is None or ndim == 0:
        return None
    weight_dim, bias_dim = STYLES[style]
    dim = bias_dim if leaf == "bias" else weight_dim
    if dim is None:
        return None
    return dim % ndim


def shard_source(t: TensorSource, dim: int, tp_size: int, tp_rank: int) -> TensorSource:
    """This rank's slice of `t` along `dim` (0 or the last), as a file region."""
    if dim not in (0, len(t.shape) - 1):
        raise CheckpointError(f"tensor {t.name!r}: cannot shard along dim {dim} of shape {t.shape}; "
                              "only the first or the last dim")
    if t.shape[dim] % tp_size:
        raise CheckpointError(f"tensor {t.name!r}: dim {dim} of shape {t.shape} does not split into "
                              f"{tp_size} equal parts")
    itemsize = DTYPES[t.dtype].itemsize
    shape = list(t.shape)
    shape[dim] //= tp_size
    if dim == 0:
        part = t.nbytes // tp_size
        return replace(t, shape=tuple(shape), offset=t.offset + tp_rank * part, nbytes=part)
    row_bytes = t.shape[-1] * itemsize
    width = shape[-1] * itemsize
    rows = t.nbytes // row_bytes if row_bytes else 0
    return replace(t, shape=tuple(shape), offset=t.offset + tp_rank * width, nbytes=rows * width, rows=rows,
                   pitch=row_bytes)


def shard(tensors, plan: TpPlan | None, tp_size: int, tp_rank: int) -> tuple[TensorSource, ...]:
    if tp_size == 1:
        return tuple(tensors)
    if plan is None:
        raise CheckpointError(f"tensor parallel size {tp_size} needs a plan: the model config has no "
                              "base_model_tp_plan; pass --tp-plan FILE (a JSON object of module pattern -> style)")
    out = []
    for t in tensors:
        dim = shard_dim(plan, t.name, len(t.shape))
        out.append(t if dim is None else shard_source(t, dim, tp_size, tp_rank))
    return tuple(out)


def plan_for(config: dict, plan_file: pathlib.Path | None) -> TpPlan | None:
    """The plan file if given, else the config's base_model_tp_plan, else None."""
    if plan_file is not None:
        try:
            plan = json.loads(pathlib.Path(plan_file).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{plan_file}: cannot read the tensor-parallel plan ({exc})") from None
        if not isinstance(plan, dict):
            raise CheckpointError(f"{plan_file}: a tensor-parallel plan is a JSON object of module pattern -> style")
        return TpPlan.from_dict(plan, str(plan_file))
    plan = config.get("base_model_tp_plan")
    return TpPlan.from_dict(plan, "config.json base_model_tp_plan") if isinstance(plan, dict) else None

