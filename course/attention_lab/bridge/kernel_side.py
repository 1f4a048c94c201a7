"""The kernel's end of the bridge: it answers the trusted checker's requests while a graded
test cell runs, calling the student's code and sending back data.

The grader starts it in the student's kernel (``serve(path)``: connect to the checker's socket,
answer until it says "done").  Nothing here decides anything: the student's code owns this
process and may change any of it, which changes at most the data sent back -- and the checker
treats that data as what it is, the output of the student's code.  The requests:

* ``lookup``: the notebook's globals of these names (data, or handles to the objects);
* ``getattr`` / ``source``: an attribute of a handle; the source code of a function or class;
* ``call``: call a handle (or one of its methods) with these arguments, inside these probes
  (measurements the checker asked for: :mod:`attention_lab.bridge.probes`), and send back the
  result or the exception raised, the probes' findings and the random number generators' state;
* ``done``.

Every reply also carries the memory the student's code changed (:mod:`attention_lab.bridge.peer`)
and the modules whose state changed (:mod:`attention_lab.bridge.modules`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import socket
import sys
import traceback
from typing import Any

import numpy as np
import torch
from torch import nn

from attention_lab.bridge import modules, probes, wire
from attention_lab.bridge.peer import Peer, flat_tensors, random_state, set_random_state

MAX_MESSAGE_TEXT = 2000
MAX_GRAPHS = 256  # calls whose autograd graph is kept for a backward pass (the oldest go first)
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937")  # an exception's message, as the checker may show it
MAX_SOURCE = 200_000


def exception_data(error: BaseException) -> dict:
    """An exception as data: its class name, the built-in exception classes it derives from, and
    its message (cut); never the object."""
    builtin_bases = [klass.__name__ for klass in type(error).__mro__
                     if klass.__module__ == "builtins" and issubclass(klass, BaseException)]
    try:
        message = str(error)
    except Exception:  # a __str__ that raises
        message = "<an exception whose message cannot be read>"
    frames = []
    with contextlib.suppress(Exception):
        for frame in traceback.extract_tb(error.__traceback__)[-8:]:
            if not frame.filename.startswith("<"):
                continue  # only code typed in the notebook
            frames.append([frame.filename[:80], int(frame.lineno or 0), frame.name[:80], (frame.line or "")[:200]])
    return {"type": type(error).__name__[:100], "bases": builtin_bases, "message": message[:MAX_MESSAGE_TEXT],
            "frames": frames}


def _dataclass_fields(cls: type, encoder: wire.Encoder) -> list | None:
    """[name, default or {"$": "empty"}] of each field of a dataclass (None for other classes)."""
    fields = getattr(cls, "__dataclass_fields__", None)
    if not isinstance(fields, dict) or not dataclasses.is_dataclass(cls):
        return None
    described = []
    for field in dataclasses.fields(cls):
        default = field.default
        try:
            default_data = {"$": "empty"} if default is dataclasses.MISSING else encoder.encode(default)
        except wire.WireError:
            default_data = {"$": "empty"}
        described.append([str(field.name)[:200], default_data])
    return described


def _signature(obj: Any) -> list | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parameters = []
    for parameter in signature.parameters.values():
        default = parameter.default
        if default is inspect.Parameter.empty:
            default_data = {"$": "empty"}
        elif default is None or type(default) in (bool, int, float, str):
            default_data = default if type(default) is not float or default == default else None
        else:
            default_data = {"$": "opaque"}
        parameters.append([parameter.name, int(parameter.kind), default_data])
    return parameters


class Agent(Peer):
    """The kernel's side: its handles (the student's objects the checker holds) and its answers."""

    def __init__(self, namespace: dict):
        super().__init__("k")
        self.namespace = namespace
        self.handles: dict[str, Any] = {}
        self.handle_of: dict[int, str] = {}  # id(obj) -> handle (objects are kept alive by self.handles)
        self.synced_modules: dict[str, tuple] = {}  # module handle -> its fingerprint as last sent
        self.call_generators: list[tuple[int, np.random.Generator]] = []  # the checker's, in this request
        self.call_arrays: list[tuple[int, np.ndarray, np.ndarray]] = []  # (index, array, its bytes before)
        self.call_objects: dict[str, Any] = {}  # the checker's course objects in this request, by id
        self.graphs: dict[str, tuple[list, list]] = {}  # call -> (its output tensors, its graph inputs)

    # -- objects -----------------------------------------------------------------------
    def handle(self, obj: Any) -> tuple[str, bool]:
        """(handle of obj, whether it is new)."""
        existing = self.handle_of.get(id(obj))
        if existing is not None and self.handles.get(existing) is obj:
            return existing, False
        handle = self.new_id()
        self.handles[handle] = obj
        self.handle_of[id(obj)] = handle
        return handle, True

    def describe(self, obj: Any, encoder: wire.Encoder) -> dict:
        handle, new = self.handle(obj)
        if handle.startswith("c"):  # one of the checker's own objects, handed back
            return {"$": "ref", "h": handle}
        if isinstance(obj, nn.Module):
            described = {"$": "module", "h": handle}
            if new or handle not in self.synced_modules:
                described.update(self._module_fields(obj, handle, encoder))
            return described
        name = getattr(obj, "__name__", None)
        described = {"h": handle, "type": type(obj).__qualname__[:200],
                     "name": name[:200] if isinstance(name, str) else None,
                     "qualname": str(getattr(obj, "__qualname__", "") or "")[:200],
                     "signature": _signature(obj) if callable(obj) else None}
        if isinstance(obj, type):
            described.update({"$": "class", "module_class": issubclass(obj, nn.Module),
                              "autograd_function": issubclass(obj, torch.autograd.Function),
                              "torch": modules.torch_classes(obj) if issubclass(obj, nn.Module) else [],
                              "dataclass": _dataclass_fields(obj, encoder)})
        elif callable(obj):
            described["$"] = "function"
        else:
            described.update({"$": "object", "dataclass": _dataclass_fields(type(obj), encoder)})
        return described

    def _module_fields(self, module: nn.Module, handle: str, encoder: wire.Encoder) -> dict:
        cls = type(module)
        state = modules.state(module, lambda v: self.encode_value(v, encoder, share=True))
        self.synced_modules[handle] = modules.fingerprint(module, self.sid_of)  # (its tensors are shared now)
        return {"class": cls.__qualname__[:200], "torch": modules.torch_classes(cls),
                "builtin": modules.is_torch_class(cls), "state": state,
                "class_handle": None if modules.is_torch_class(cls) else self.describe(cls, encoder),
                "forward": _signature(getattr(module, "forward", None))}

    def encode_value(self, value: Any, encoder: wire.Encoder, share: bool = False) -> Any:
        if share and isinstance(value, torch.Tensor):
            return self.share(value, encoder)
        return encoder.encode(value)

    def new_encoder(self) -> wire.Encoder:
        encoder = self.encoder(on_object=lambda obj: self.describe(obj, encoder), share_all=False)
        return encoder

    def module_changes(self, encoder: wire.Encoder) -> list:
        changed = []
        for handle in list(self.synced_modules):
            module = self.handles.get(handle)
            if isinstance(module, nn.Module) and modules.fingerprint(module, self.sid_of) != self.synced_modules[handle]:
                changed.append([handle, self._module_fields(module, handle, encoder)["state"]])
        return changed

    # -- incoming values -----------------------------------------------------------------
    def decode(self, value: Any, buffers: list[bytes]) -> Any:
        decoder = self.decoder(buffers, self._tagged)
        decoder.on_array = self._received_array
        self._current_decoder = decoder
        return decoder.decode(value)

    def _tagged(self, tag: str, fields: dict) -> Any:
        if tag == "ref":
            handle = fields.get("h")
            if handle not in self.handles:
                raise wire.WireError("a reference to an unknown object")
            return self.handles[handle]
        if tag == "cmodule":  # a module of the checker's (PyTorch's own class), first sent
            handle = fields.get("h")
            if not isinstance(handle, str) or not handle.startswith("c") or len(handle) > 24:
                raise wire.WireError("a malformed module id")
            if handle in self.handles:
                return self.handles[handle]
            module = modules.empty_instance(modules.torch_module_class(fields.get("class")))
            self.handles[handle] = module
            self.handle_of[id(module)] = handle
            modules.apply_state(module, fields.get("state"), self._current_decoder.decode)
            self.synced_modules[handle] = modules.fingerprint(module, self.sid_of)
            return module
        if tag == "npgenerator":
            return self._generator(fields)
        if tag == "torch_generator":
            return self._torch_generator(fields.get("state"))
        if tag == "dataloader":
            return self._loader(fields)
        if tag == "course_object":  # an object of the course's (a check's configuration, its cache)
            return self._course_object(fields)
        raise wire.WireError(f"an unknown tag {tag[:20]!r}")

    def _course_object(self, fields: dict) -> Any:
        """The kernel's copy of a checker's object of a course class, in the state sent (its class
        is the course's own, found by name; its __init__ is not run)."""
        handle = fields.get("h")
        if not isinstance(handle, str) or not handle.startswith("c") or len(handle) > 24:
            raise wire.WireError("a malformed object id")
        state = self._current_decoder.decode(fields.get("state"))
        if not isinstance(state, dict) or not all(isinstance(k, str) and k.isidentifier() for k in state):
            raise wire.WireError("a malformed object state")
        obj = self.handles.get(handle)
        if obj is None:
            obj = object.__new__(course_class(fields.get("class")))
            self.handles[handle] = obj
            self.handle_of[id(obj)] = handle
        vars(obj).clear()
        vars(obj).update(state)
        self.call_objects[handle] = obj
        return obj

    def _torch_generator(self, state_data: Any) -> torch.Generator:
        state = self._current_decoder.decode(state_data)
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise wire.WireError("a malformed torch generator")
        generator = torch.Generator()
        try:
            generator.set_state(state.clone())
        except RuntimeError:
            raise wire.WireError("an invalid torch generator state") from None
        return generator

    def _loader(self, fields: dict) -> "torch.utils.data.DataLoader":
        """The checker's DataLoader, rebuilt: the same tensors, batches and order."""
        from torch.utils.data import DataLoader, TensorDataset

        tensors = self._current_decoder.decode(fields.get("tensors"))
        batch_size = fields.get("batch_size")
        if not (isinstance(tensors, tuple) and tensors and all(isinstance(t, torch.Tensor) for t in tensors)
                and len({len(t) for t in tensors}) == 1 and type(batch_size) is int and batch_size > 0):
            raise wire.WireError("a malformed DataLoader")
        generator = None if fields.get("generator") is None else self._torch_generator(fields["generator"])
        return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=bool(fields.get("shuffle")),
                          drop_last=bool(fields.get("drop_last")), generator=generator)

    def _received_array(self, array: np.ndarray, fields: dict) -> None:
        """An array of the checker's: its bytes now, to send back whatever the call changes."""
        if type(fields.get("i")) is int:
            self.call_arrays.append((fields["i"], array, array.copy()))

    def _generator(self, fields: dict) -> np.random.Generator:
        """A random generator in the state the checker's was in (its state goes back after the call)."""
        bits = fields.get("bits")
        if bits not in BIT_GENERATORS or type(fields.get("i")) is not int:
            raise wire.WireError("a malformed random generator")
        generator = np.random.Generator(getattr(np.random, bits)())
        try:
            generator.bit_generator.state = self._current_decoder.decode(fields.get("state"))
        except (TypeError, ValueError, KeyError):
            raise wire.WireError("an invalid random generator state") from None
        self.call_generators.append((fields["i"], generator))
        return generator

    def apply_module_changes(self, changes: Any, buffers: list[bytes]) -> None:
        if not isinstance(changes, list):
            raise wire.WireError("malformed module changes")
        decoder = self.decoder(buffers, self._tagged)
        self._current_decoder = decoder
        for item in changes:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(self.handles.get(item[0]), nn.Module)):
                raise wire.WireError("a change to an unknown module")
            module = self.handles[item[0]]
            modules.apply_state(module, item[1], decoder.decode)
            self.synced_modules[item[0]] = modules.fingerprint(module, self.sid_of)

    # -- requests ------------------------------------------------------------------------
    def answer(self, request: dict, buffers: list[bytes]) -> tuple[dict, wire.Encoder]:
        self.call_generators, self.call_arrays, self.call_objects = [], [], {}
        self.apply_module_changes(request.get("modules", []), buffers)
        encoder = self.new_encoder()
        operation = request.get("op")
        if operation == "lookup":
            names = request.get("names")
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise wire.WireError("malformed names")
            values = []
            for name in names:
                values.append(self._encode_or_raised(lambda: self.namespace[name], encoder, missing=KeyError))
            reply = {"values": values}
        elif operation == "getattr":
            target, name = self._target(request), request.get("name")
            if not isinstance(name, str):
                raise wire.WireError("a malformed attribute name")
            reply = self._encode_or_raised(lambda: getattr(target, name), encoder, missing=AttributeError)
        elif operation == "source":
            target = self._target(request)
            try:
                source = inspect.getsource(target)[:MAX_SOURCE]
            except (OSError, TypeError):
                source = None
            reply = {"value": source}
        elif operation == "call":
            reply = self._call(request, buffers, encoder)
        elif operation == "backward":
            reply = self._backward(request, buffers, encoder)
        elif operation == "deepcopy":  # copy.deepcopy of a student's object: the copy stays here too
            target = self._target(request)
            reply = self._encode_or_raised(lambda: copy.deepcopy(target), encoder, missing=())
        elif operation == "measure":
            target = self._target(request)
            self.current_buffers = buffers
            (probe,) = probes.from_requests([request.get("probe")], self)
            try:
                reply = {"findings": encoder.encode(probe.measure(target))}
            except Exception as error:  # the student's objects are odd: the checker decides what that means
                reply = {"raised": exception_data(error)}
        else:
            raise wire.WireError(f"an unknown request {str(operation)[:20]!r}")
        reply["modules"] = self.module_changes(encoder)
        reply["generators"] = [[index, encoder.encode(generator.bit_generator.state)]
                               for index, generator in self.call_generators]
        reply["objects"] = [[handle, encoder.encode(dict(vars(obj)))] for handle, obj in self.call_objects.items()]
        reply["arrays"] = [[index, encoder.encode(array.view(np.ndarray))] for index, array, before in self.call_arrays
                           if not np.array_equal(array, before, equal_nan=array.dtype.kind in "fc")]
        return reply, encoder

    def _keep_graph(self, result: Any, parameters: Any) -> str:
        """Keep the call's autograd graph (outputs, inputs) for the checker's backward; its id."""
        if not isinstance(parameters, list):
            raise wire.WireError("malformed parameters")
        inputs = [self.graph_inputs[index] for index in sorted(self.graph_inputs)]
        named_parameters: dict[str, dict[str, nn.Parameter]] = {}  # by module handle: one walk of each module
        for item in parameters:
            module = self.handles.get(item[0]) if isinstance(item, list) and len(item) == 2 else None
            if not isinstance(module, nn.Module) or not isinstance(item[1], str):
                raise wire.WireError("a parameter of an unknown module")
            if item[0] not in named_parameters:
                named_parameters[item[0]] = dict(module.named_parameters())
            parameter = named_parameters[item[0]].get(item[1])
            inputs.append(parameter if parameter is not None else torch.zeros(()))
        graph = self.new_id()
        self.graphs[graph] = (flat_tensors(result), inputs)
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        return graph

    def _backward(self, request: dict, buffers: list[bytes], encoder: wire.Encoder) -> dict:
        graph = self.graphs.get(request.get("graph"))
        if graph is None:
            raise wire.WireError("a backward pass of an unknown call")
        outputs, inputs = graph
        gradients = self.decode(request.get("gradients"), buffers)
        if not isinstance(gradients, list) or len(gradients) != len(outputs):
            raise wire.WireError("gradients for the wrong number of outputs")
        pairs = [(o, g) for o, g in zip(outputs, gradients) if isinstance(g, torch.Tensor) and o.requires_grad]
        wanted = [i for i, tensor in enumerate(inputs) if tensor.requires_grad]
        found: list = [None] * len(inputs)
        if pairs and wanted:
            try:
                computed = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted],
                                               [g for _, g in pairs], allow_unused=True, retain_graph=True)
            except Exception as error:  # the student's backward (an autograd.Function's) raised
                return {"raised": exception_data(error)}
            for i, gradient in zip(wanted, computed):
                found[i] = gradient
        return {"value": encoder.encode(found)}

    def _target(self, request: dict) -> Any:
        handle = request.get("target")
        if handle not in self.handles:
            raise wire.WireError("a request about an unknown object")
        return self.handles[handle]

    def _encode_or_raised(self, get, encoder: wire.Encoder, missing: type[BaseException]) -> dict:
        try:
            value = get()
        except missing:
            return {"missing": True}
        except Exception as error:  # a property of the student's that raised
            return {"raised": exception_data(error)}
        try:
            return {"value": encoder.encode(value)}
        except wire.WireError as error:
            return {"unsendable": str(error)}

    def _call(self, request: dict, buffers: list[bytes], encoder: wire.Encoder) -> dict:
        target = self._target(request)
        method = request.get("method")
        if method is not None:
            if not isinstance(method, str):
                raise wire.WireError("a malformed method name")
            target = getattr(target, method)
        self.graph_inputs = {}
        args = self.decode(request.get("args", {"$": "tuple", "v": []}), buffers)
        kwargs = self.decode(request.get("kwargs", {"$": "dict", "v": []}), buffers)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise wire.WireError("malformed arguments")
        self.current_buffers = buffers
        active = probes.from_requests(request.get("probes", []), self)
        set_random_state(request.get("random"), lambda value: self.decode(value, buffers))
        reply: dict = {}
        with torch.set_grad_enabled(bool(request.get("grad", False))):
            try:
                with contextlib.ExitStack() as stack:
                    for probe in active:
                        stack.enter_context(probe)
                    result = target(*args, **kwargs)
                for probe in active:
                    probe.returned(result, args)
                reply["value"] = encoder.encode(result)
                if request.get("graph"):
                    reply["graph"] = self._keep_graph(result, request.get("parameters", []))
            except wire.WireError as error:
                reply["unsendable"] = str(error)
            except BaseException as error:  # noqa: BLE001 -- the student's exception, as data (SystemExit too)
                if isinstance(error, KeyboardInterrupt):
                    raise
                reply["raised"] = exception_data(error)
        reply["probes"] = [encoder.encode(probe.findings()) for probe in active]
        reply["random"] = random_state(encoder)
        return reply


def course_class(name: Any) -> type:
    """A plain class of the course package (no module, no exception), by (module, class name)."""
    if not (isinstance(name, list) and len(name) == 2 and all(isinstance(part, str) for part in name)
            and name[0].startswith("attention_lab.") and name[1].isidentifier()):
        raise wire.WireError("a class that is not the course's")
    try:
        cls = getattr(importlib.import_module(name[0]), name[1], None)
    except ImportError:
        cls = None
    if not (isinstance(cls, type) and cls.__module__ == name[0] and not issubclass(cls, (nn.Module, BaseException))):
        raise wire.WireError("a class that is not one of the course's")
    return cls


def serve(path: str, namespace: dict | None = None, timeout: float = 600) -> None:
    """Connect to the checker at ``path`` and answer its requests until it says it is done."""
    if namespace is None:
        from IPython import get_ipython

        shell = get_ipython()
        namespace = shell.user_ns if shell is not None else vars(sys.modules["__main__"])
    connection = socket.socket(socket.AF_UNIX)
    connection.settimeout(timeout)
    connection.connect(path)
    answer_until_done(Agent(namespace), connection)


def answer_until_done(agent: Agent, connection: socket.socket) -> None:
    """Answer the requests arriving on ``connection`` until the checker says it is done (or goes)."""
    try:
        while True:
            request, buffers = agent.receive(connection)
            if request.get("op") == "done":
                return
            try:
                reply, encoder = agent.answer(request, buffers)
            except wire.WireError as error:
                reply, encoder = {"error": str(error)[:MAX_MESSAGE_TEXT]}, agent.new_encoder()
            agent.send(connection, reply, encoder)
    except (EOFError, OSError, wire.WireError):
        return
    finally:
        connection.close()
