"""Modules across the bridge: their state as data, and rebuilding PyTorch's own module classes.

A module's *state* is what a check can see of it without calling it: its parameters and
buffers (tensors on shared storages), its children, its ``training`` flag and its plain
attributes (numbers, strings, tuples of them).  Both sides compare a module's state with the
state last sent (:func:`fingerprint`) and send it again when it changed: a student's
``load_state_dict`` in the kernel, a check's ``module.to(torch.float32)`` in the checker.

Only classes of ``torch.nn`` itself are ever instantiated from a message, by name
(:func:`torch_module_class`): a student's class stays in the kernel, and the checker sees it
through a proxy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attention_lab.bridge import wire

PLAIN = (bool, int, float, str, type(None))


def torch_class_name(cls: type) -> str:
    """How a class of PyTorch's travels: ``torch.nn.modules.linear.Linear``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def torch_module_class(name: Any) -> type[nn.Module]:
    """The module class called ``name``: one of PyTorch's (``torch.nn.modules.<file>.<Class>``) or of the
    course package (a check's own module, ``attention_lab.checks.<file>.<Class>``), never anything else."""
    module_name, _, class_name = name.rpartition(".") if isinstance(name, str) and len(name) < 200 else ("", "", "")
    if not ((module_name.startswith("torch.nn.modules.") or is_course_module(module_name)) and class_name.isidentifier()):
        raise wire.WireError(f"{str(name)[:60]!r} is not a module class of torch.nn or of the course")
    import importlib

    try:
        cls = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module_name):
        raise wire.WireError(f"{str(name)[:60]!r} is not a module class of torch.nn")
    return cls


def is_course_module(module_name: str) -> bool:
    """A module of the course package whose classes may be rebuilt from a message (not the bridge's)."""
    return module_name.startswith("attention_lab.") and not module_name.startswith("attention_lab.bridge")


def is_sendable_class(cls: type) -> bool:
    """A module class the other side can rebuild by name: PyTorch's own, or the course's."""
    return is_torch_class(cls) or (is_course_module(cls.__module__ or "") and "<" not in cls.__qualname__
                                   and "." not in cls.__qualname__)


def is_torch_class(cls: type) -> bool:
    """A class of torch.nn itself (not a subclass a student wrote)."""
    return (cls.__module__ or "").startswith("torch.nn.modules.") and "<" not in cls.__qualname__


def torch_classes(cls: type) -> list[str]:
    """The ``torch.nn`` classes among ``cls`` and its bases, nearest first (nn.Module last)."""
    return [torch_class_name(klass) for klass in cls.__mro__ if isinstance(klass, type) and is_torch_class(klass)]


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, PLAIN) and type(value) in PLAIN:
        return not isinstance(value, str) or len(value) < 1000
    if type(value) in (tuple, list) and depth < 3 and len(value) < 64:
        return all(_plain(item, depth + 1) for item in value)
    return isinstance(value, torch.dtype)


# nn.Module's own bookkeeping: never sent, never set from a message.
MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training", "forward", "__class__", "__dict__"}


def plain_attributes(module: nn.Module) -> dict[str, Any]:
    """The module's own attributes that are plain data (``num_heads``, ``eps``, PyTorch's private
    ``_qkv_same_embed_dim``...)."""
    return {name: value for name, value in vars(module).items()
            if name not in MODULE_INTERNALS and not name.startswith("__") and _plain(value)}


def fingerprint(module: nn.Module, sid_of) -> tuple:
    """What a change of the module's state would change (``sid_of``: a tensor's shared storage)."""
    def tensor_key(tensor):
        if tensor is None:
            return None
        return (sid_of(tensor), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                isinstance(tensor, nn.Parameter), tensor.requires_grad)

    return (module.training,
            tuple((name, tensor_key(p)) for name, p in module._parameters.items()),
            tuple((name, tensor_key(b)) for name, b in module._buffers.items()),
            tuple(sorted(module._non_persistent_buffers_set)),
            tuple((name, tensor_key(t)) for name, t in vars(module).items()
                  if isinstance(t, torch.Tensor) and not name.startswith("_")),
            tuple((name, id(child)) for name, child in module._modules.items()),
            tuple(sorted((name, repr(value)) for name, value in plain_attributes(module).items())))


def state(module: nn.Module, encode) -> dict:
    """The module's state, its tensors and children encoded by ``encode``."""
    tensors = {name: value for name, value in vars(module).items()
               if isinstance(value, torch.Tensor) and not name.startswith("_")}
    return {"training": bool(module.training),
            "non_persistent": sorted(str(name) for name in module._non_persistent_buffers_set),
            "params": [[name, encode(p)] for name, p in module._parameters.items()],
            "tensors": [[name, encode(t)] for name, t in tensors.items()],
            "buffers": [[name, encode(b)] for name, b in module._buffers.items()],
            "children": [[name, encode(child)] for name, child in module._modules.items()],
            "attrs": [[name, encode(value)] for name, value in plain_attributes(module).items()]}


def _named(items: Any, what: str) -> list[tuple[str, Any]]:
    """(name, value) pairs of a module's state: names as PyTorch allows them (``0`` in a Sequential)."""
    if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                              and 0 < len(p[0]) < 200 and "." not in p[0] for p in items):
        raise wire.WireError(f"malformed module {what}")
    return [(name, value) for name, value in items]


def apply_state(module: nn.Module, fields: dict, decode) -> None:
    """Set ``module``'s state from a message. A tensor replacing one of the same kind keeps the
    Parameter object (``param.data = ...``), as an in-place conversion would."""
    if not isinstance(fields, dict):
        raise wire.WireError("a malformed module state")
    module.training = bool(fields.get("training", True))
    params = _named(fields.get("params", []), "parameters")
    for name in set(module._parameters) - {name for name, _ in params}:
        del module._parameters[name]  # the other side removed it (``del module.weight``)
    for name, value in _named(fields.get("tensors", []), "tensors"):
        tensor = decode(value)
        if not isinstance(tensor, torch.Tensor) or name in MODULE_INTERNALS or not name.isidentifier():
            raise wire.WireError("a plain tensor attribute that is not a tensor")
        object.__setattr__(module, name, tensor)
    for name, value in params:
        tensor = decode(value)
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise wire.WireError("a parameter that is not a tensor")
        current = module._parameters.get(name)
        if isinstance(tensor, nn.Parameter) and isinstance(current, nn.Parameter):
            if current.data.data_ptr() != tensor.data.data_ptr() or current.shape != tensor.shape \
                    or current.dtype != tensor.dtype or current.stride() != tensor.stride():
                current.data = tensor.data
            current.requires_grad_(tensor.requires_grad)
        elif tensor is None or isinstance(tensor, nn.Parameter):
            module._parameters[name] = tensor
        else:  # a plain tensor where a parameter was: as the student's code left it
            module._parameters.pop(name, None)
            object.__setattr__(module, name, tensor)
    buffers = _named(fields.get("buffers", []), "buffers")
    for name in set(module._buffers) - {name for name, _ in buffers}:
        del module._buffers[name]
    for name, value in buffers:
        tensor = decode(value)
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise wire.WireError("a buffer that is not a tensor")
        module._buffers[name] = tensor
    non_persistent = fields.get("non_persistent", [])
    if not isinstance(non_persistent, list) or not all(isinstance(name, str) for name in non_persistent):
        raise wire.WireError("malformed non-persistent buffers")
    module._non_persistent_buffers_set = set(non_persistent) & set(module._buffers)
    children = {}
    for name, value in _named(fields.get("children", []), "children"):
        child = decode(value)
        if child is not None and not isinstance(child, nn.Module):
            raise wire.WireError("a child module that is not a module")
        children[name] = child
    module._modules.clear()
    module._modules.update(children)
    for name, value in _named(fields.get("attrs", []), "attributes"):
        if name in MODULE_INTERNALS or name.startswith("__") or not name.isidentifier():
            raise wire.WireError(f"attribute {name} cannot be set")
        object.__setattr__(module, name, decode(value))


def empty_instance(cls: type[nn.Module]) -> nn.Module:
    """An instance of ``cls`` with nothing in it yet (its __init__ is not run: the state follows)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    return module
