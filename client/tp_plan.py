"""The tensor-parallel plan: which slice of each tensor a rank holds.

One definition for both sides: the daemon cuts file regions by it (daemon/sharding.py)
and an engine loading from disk slices tensors by it (disk.load_from_disk), so a rank
gets the same bytes either way.

A plan maps module-name patterns to styles, as transformers' `base_model_tp_plan`
does ({"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}).
`*` stands for one dotted segment. Patterns match a module path or any suffix of it
after whole segments, so "layers.*.mlp.down_proj" also matches
"model.layers.3.mlp.down_proj". A tensor no pattern matches is replicated.

  colwise  (nn.Linear output features) weight and bias split along dim 0
  rowwise  (nn.Linear input features)  weight split along its last dim; bias replicated

Every other tensor of a module (block-wise FP8's `weight_scale_inv`) splits like its
weight, so a rank's scales cover exactly its rows or columns of blocks.
"""

import json
import pathlib
import re
from dataclasses import dataclass

from .errors import CheckpointError

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


def shard_bounds(name: str, shape, dim: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, stop) of this rank's part of dim `dim` (the first or the last) of a tensor."""
    shape = tuple(shape)
    if dim not in (0, len(shape) - 1):
        raise CheckpointError(f"tensor {name!r}: cannot shard along dim {dim} of shape {shape}; "
                              "only the first or the last dim")
    if shape[dim] % tp_size:
        raise CheckpointError(f"tensor {name!r}: dim {dim} of shape {shape} does not split into "
                              f"{tp_size} equal parts")
    part = shape[dim] // tp_size
    return tp_rank * part, (tp_rank + 1) * part


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
