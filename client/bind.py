"""Point a module built on the meta device at weights that live elsewhere."""

from .errors import BindError


def _slots(module):
    """(qualified name, owning module, attribute, tensor, persistent) for every
    parameter and buffer, shared (tied) ones listed under each of their names."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, param in owner._parameters.items():
            if param is not None:
                yield f"{dot}{attr}", owner, attr, param, True
        for attr, buf in owner._buffers.items():
            if buf is not None:
                yield f"{dot}{attr}", owner, attr, buf, attr not in owner._non_persistent_buffers_set


def bind(module, weights: dict) -> None:
    """Make every parameter and persistent buffer of `module` the tensor of the same
    name in `weights` (no copy), keeping tied weights tied.

    Raises BindError listing every parameter or persistent buffer with no tensor,
    every shape or dtype that differs, and every tensor nothing took. Non-persistent
    buffers are bound when the checkpoint has them and left alone otherwise.
    """
    import torch

    groups: dict[int, list] = {}
    for slot in _slots(module):
        groups.setdefault(id(slot[3]), []).append(slot)

    problems, used, plan = [], set(), []
    for slots in groups.values():
        names = [s[0] for s in slots]
        found = [n for n in names if n in weights]
        current, required = slots[0][3], any(s[4] for s in slots)
        if not found:
            if required:
                problems.append(f"missing: {' = '.join(names)} (no tensor of that name)")
            continue
        tensor = weights[found[0]]
        used.update(found)
        if tuple(tensor.shape) != tuple(current.shape) or tensor.dtype != current.dtype:
            problems.append(
                f"mismatch: {found[0]} expects {tuple(current.shape)} {current.dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
            continue
        plan.append((slots, tensor))
    unexpected = sorted(set(weights) - used)
    problems += [f"unexpected: {name} (no parameter or buffer of that name)" for name in unexpected]
    if problems:
        raise BindError(f"{len(problems)} problem(s) binding weights to {type(module).__name__}:\n  "
                        + "\n  ".join(problems))

    for slots, tensor in plan:
        if isinstance(slots[0][3], torch.nn.Parameter):
            value = torch.nn.Parameter(tensor, requires_grad=False)
            for _, owner, attr, _, _ in slots:
                owner._parameters[attr] = value
        else:
            for _, owner, attr, _, _ in slots:
                owner._buffers[attr] = tensor
