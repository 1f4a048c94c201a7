"""The checker's end of the bridge: the student's objects, as the checks see them in grading.

In grading, a test cell runs in the trusted checker, and every name it takes from the notebook
(``split_heads``, ``MultiHeadSelfAttention``, ``ANSWER_DRAFT_BUG``) is looked up in the
student's kernel (:meth:`Bridge.lookup`): data arrives as data (a string, a number, a tensor),
anything else as a proxy that the unchanged checks use as they use the real object:

* a function or class: :class:`RemoteCallable` -- calling it calls it in the kernel, with its
  signature, name and namespace (``__globals__``) as the kernel describes them;
* a module (``nn.Module``): :class:`RemoteModule`, a real ``nn.Module`` on this side whose
  parameters, buffers, children and plain attributes mirror the kernel's (PyTorch's own
  classes, ``nn.Linear`` ..., are rebuilt as themselves), and whose call runs its forward in
  the kernel;
* anything else: :class:`RemoteObject` (attributes and calls go to the kernel).

Arguments travel the other way: tensors and arrays as shared memory, PyTorch's own modules and
the course's objects rebuilt from their state, proxies as references to the kernel's objects.
What the student's code does to them comes back only where it may: into the student's own
objects (the memory their modules hold), and into the arguments a check says a call writes
(``writes``: the module ``load_torch_mha_weights`` loads, a cache a forward fills). Whatever else it
changed of the checker's objects -- a tensor, an array, a module or a configuration the check still
reads -- stays as it was here; what the student's code left of them is kept beside them for the
last request (:class:`LeftBehind`), which is what the inputs-unchanged rule of the checks reads.
Each request has a time limit; a kernel that answers late, with too much, or with anything that is
not well-formed data fails the test with :class:`BridgeError`, which the checks do not catch.
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import socket
import time
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from attention_lab.bridge import modules, probes as probes_module, wire
from attention_lab.bridge.peer import Peer, flat_tensors, random_state, set_random_state


class BridgeError(Exception):
    """The student's kernel broke the protocol, answered too late or sent what cannot be data.
    Not a CheckFailure (checks never catch it): the test fails with this message."""


DRIPPED = ("your notebook's kernel sent its answer a little at a time, past this test's {limit:.0f} s (its copy of "
           "the course's bridge was rewritten): the grader stops calling your code for this notebook")


# The exception classes an answer's exception may arrive as: the built-in ones (so that the
# checks' ``except ValueError`` works), never BaseException-only ones (SystemExit,
# KeyboardInterrupt: those would stop the checker), never the course's own (CheckFailure).
_BUILTIN_EXCEPTIONS = {name: cls for name, cls in vars(builtins).items()
                       if isinstance(cls, type) and issubclass(cls, Exception)}


class StudentException(Exception):
    """An exception the student's code raised in the kernel, rebuilt from its name and message."""

    frames: list = []


_exception_classes: dict[tuple[str, tuple[str, ...]], type] = {}


def _exception(data: Any) -> StudentException:
    if not (isinstance(data, dict) and isinstance(data.get("bases", []), list)):
        raise BridgeError("the kernel sent a malformed exception")
    name = str(data.get("type", "Exception"))[:100]
    bases = tuple(b for b in data.get("bases", []) if isinstance(b, str) and b in _BUILTIN_EXCEPTIONS)[:1]
    key = (name, bases)
    if key not in _exception_classes:
        base = _BUILTIN_EXCEPTIONS[bases[0]] if bases else Exception
        namespace = {"__module__": "student"}
        _exception_classes[key] = type(name if name.isidentifier() else "StudentException",
                                       (StudentException, base) if base is not Exception else (StudentException,),
                                       namespace)
    message = str(data.get("message", ""))[:2000]
    error = _exception_classes[key](message)
    frames = data.get("frames", [])
    error.frames = frames if isinstance(frames, list) else []
    return error


student_exception = _exception  # an exception the kernel reported as data (a probe's too), rebuilt here


def _signature(data: Any) -> inspect.Signature | None:
    if data is None:
        return None
    if not isinstance(data, list):
        raise BridgeError("the kernel sent a malformed signature")
    parameters = []
    try:
        for item in data:
            name, kind, default = item
            if not (isinstance(name, str) and name.isidentifier() and type(kind) is int and 0 <= kind <= 4):
                raise BridgeError("the kernel sent a malformed signature")
            if isinstance(default, dict):
                default = inspect.Parameter.empty if default.get("$") == "empty" else _OpaqueDefault()
            parameters.append(inspect.Parameter(name, inspect._ParameterKind(kind), default=default))
        return inspect.Signature(parameters)
    except (ValueError, TypeError):
        raise BridgeError("the kernel sent a malformed signature") from None


class LeftBehind:
    """What the student's code left of the checker's objects in one request, where it may not write
    them: the memory of a tensor (a copy holding the kernel's bytes), an array, a course object's
    fields, a module's state. The checker's objects themselves are unchanged."""

    def __init__(self):
        self.storages: dict[int, torch.Tensor] = {}  # address of the checker's storage -> the kernel's copy
        self.arrays: dict[int, np.ndarray] = {}      # id(array) -> the array as the kernel left it
        self.objects: dict[int, dict] = {}           # id(course object) -> its fields as the kernel left them
        self.modules: dict[int, nn.Module] = {}      # id(module) -> a module of its class in the kernel's state

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the kernel left it: a view of the kernel's copy of its memory (or itself)."""
        copy = self.storages.get(Peer._pointer(tensor)) if isinstance(tensor, torch.Tensor) else None
        if copy is None:
            return tensor
        view = torch.empty(0, dtype=tensor.dtype)
        view.set_(copy.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
        return view

    def array(self, array: np.ndarray) -> np.ndarray:
        return self.arrays.get(id(array), array)

    def fields(self, obj: Any) -> dict | None:
        """A course object's fields as the kernel left them, or None when it left them as they were."""
        return self.objects.get(id(obj))

    def module(self, module: nn.Module) -> nn.Module:
        """``module`` as the kernel left it (a stand-in holding the kernel's state, or itself)."""
        return self.modules.get(id(module), module)

    def __bool__(self) -> bool:
        return bool(self.storages or self.arrays or self.objects or self.modules)


class _OpaqueDefault:
    """A default value that is not data (it stays in the kernel)."""

    def __repr__(self) -> str:
        return "<default>"


class Bridge(Peer):
    """The checker's connection to one student's kernel, for one test cell."""

    def __init__(self, connection: socket.socket, timeout: float):
        super().__init__("c")
        self.connection = connection
        self.timeout = timeout  # for the whole test cell, as a kernel's cell has
        self.deadline = time.monotonic() + timeout
        self.requests = 0  # crossings so far (for the benchmarks)
        self.proxies: dict[str, Any] = {}  # kernel handle -> its proxy (one proxy per object)
        self.sent_modules: dict[int, tuple[str, nn.Module]] = {}  # id(checker module) -> (its id, the module)
        self.synced: dict[str, tuple] = {}  # module id (either side's) -> fingerprint as last synced
        self.ambient: list[probes_module.Probe] = []  # probes entered around every call (a check's call trace)
        self.generators: list[np.random.Generator] = []  # the random generators sent with this request
        self.arrays: list[np.ndarray] = []  # the arrays sent with this request
        self.sent_objects: dict[int, tuple[str, Any]] = {}  # id(course object) -> (its id, the object)
        self.request_objects: dict[str, Any] = {}  # the course objects sent with this request
        self.names: dict[str, str] = {}  # handle -> the notebook's name the checker looked it up by
        # The submitted notebook's code before this test cell, read as data (code_inspection.SubmittedCode): the
        # checker's own reading of an answer's code, whatever the kernel reports; None when grading has none.
        self.submitted: Any = None
        self.contradictions: list[str] = []  # where the kernel's measurement and the submitted code disagree
        self.kept_out = False  # the kernel dripped a reply in: the notebook's later tests are not run
        self.writes: list[Any] = []  # the checker's objects the current call may write (its contract's)
        self.left = LeftBehind()  # what the last request's student code left of the checker's other objects
        self._writable: tuple[set[int], set[str]] | None = None  # (ids, storage ids) writable in this request

    # -- the exchange ------------------------------------------------------------------
    def request(self, header: dict, encoder: wire.Encoder | None = None) -> tuple[dict, wire.Decoder]:
        if encoder is None:
            self.generators, self.arrays, self.request_objects = [], [], {}
            encoder = self.new_encoder()
        self.requests += 1
        header["modules"] = self._module_changes(encoder)
        self.left, self._writable = LeftBehind(), None
        self._current_decoder = None  # (the last reply's memory: not held while the next one comes in)
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout
            self.connection.settimeout(left)
            self.send(self.connection, header, encoder)
            reply, buffers = self.receive(self.connection, self.deadline)  # whole by then, however it drips in
        except wire.Dripping:
            self.kept_out = True
            raise BridgeError(DRIPPED.format(limit=self.timeout)) from None
        except socket.timeout:
            raise BridgeError(f"this test did not finish within its {self.timeout:.0f} s: your code did not answer "
                              "in time (an endless loop, or code that keeps the grader from calling your functions)"
                              ) from None
        except (EOFError, OSError) as error:
            raise BridgeError(f"your notebook's kernel stopped answering the grader ({error})") from None
        except wire.WireError as error:
            raise BridgeError(f"your notebook's kernel sent the grader something that is not data ({error})") from None
        if "error" in reply:
            raise BridgeError(f"your notebook's kernel refused the grader's request: {str(reply['error'])[:300]}")
        decoder = self.decoder(buffers, self._tagged)
        try:
            self._apply_module_changes(reply.get("modules", []), decoder)
            self._apply_generator_states(reply.get("generators", []), decoder)
            self._apply_array_changes(reply.get("arrays", []), decoder)
            self._apply_object_states(reply.get("objects", []), decoder)
        except wire.WireError as error:
            raise BridgeError(f"your notebook's kernel sent a malformed module or generator ({error})") from None
        return reply, decoder

    # -- what the student's code may write ------------------------------------------------
    def writable(self) -> tuple[set[int], set[str]]:
        """(ids of objects, ids of storages) the kernel's changes are written into in this request: the
        memory the student's modules hold (their proxies' tensors: theirs, whoever made them), and the
        objects the call's contract says it writes (:attr:`writes`), with their tensors."""
        if self._writable is None:
            objects, tensors = set(), []
            for proxy in self.proxies.values():
                if isinstance(proxy, nn.Module):
                    tensors += _tensors_of(proxy)
            for written in self.writes:
                objects.update(id(obj) for obj in _objects_of(written))
                tensors += _tensors_of(written)
            self._writable = objects, {sid for tensor in tensors if (sid := self.sid_of(tensor)) is not None}
        return self._writable

    def takes_change(self, sid: str) -> bool:
        return not sid.startswith(self.prefix) or sid in self.writable()[1]

    def fork(self, sid: str, raw: bytes) -> torch.Tensor:
        original = self.storages[sid][0]
        copy = super().fork(sid, raw)
        if original.numel():
            self.left.storages[original.untyped_storage().data_ptr()] = copy
        return copy

    def _apply_array_changes(self, changes: Any, decoder: wire.Decoder) -> None:
        """What the student's code wrote into the arrays it was given: written into ours where the call
        may write them, else kept beside them (:attr:`left`)."""
        if not isinstance(changes, list):
            raise wire.WireError("malformed array changes")
        for item in changes:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                    and 0 <= item[0] < len(self.arrays)):
                raise wire.WireError("a change to an unknown array")
            target = self.arrays[item[0]]
            changed = decoder.decode(item[1])
            if not isinstance(changed, np.ndarray) or changed.shape != target.shape:
                raise wire.WireError("an array change of another shape")
            if id(target) not in self.writable()[0]:
                self.left.arrays[id(target)] = changed.astype(target.dtype, copy=False)
            elif target.flags.writeable:
                np.copyto(target.view(np.ndarray), changed.view(np.ndarray), casting="unsafe")

    def _apply_generator_states(self, states: Any, decoder: wire.Decoder) -> None:
        """The state the student's code left each random generator it was given in (data only)."""
        if not isinstance(states, list):
            raise wire.WireError("malformed generator states")
        for item in states:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                    and 0 <= item[0] < len(self.generators)):
                raise wire.WireError("a state for an unknown generator")
            try:
                self.generators[item[0]].bit_generator.state = decoder.decode(item[1])
            except (TypeError, ValueError, KeyError) as error:
                raise wire.WireError(f"an invalid generator state ({error})") from None

    def decode(self, value: Any, decoder: wire.Decoder) -> Any:
        try:
            return decoder.decode(value)
        except wire.WireError as error:
            raise BridgeError(f"your notebook's kernel sent the grader something that is not data ({error})") from None

    def value_of(self, reply: dict, decoder: wire.Decoder, what: str) -> Any:
        """The value a reply carries, or the student's exception raised here."""
        if "raised" in reply:
            raise _exception(reply["raised"])
        if "unsendable" in reply:
            raise BridgeError(f"{what} returned something the grader cannot receive: {str(reply['unsendable'])[:300]}")
        if "value" not in reply:
            raise BridgeError(f"your notebook's kernel sent no value for {what}")
        return self.decode(reply["value"], decoder)

    # -- outgoing values ---------------------------------------------------------------
    def new_encoder(self) -> wire.Encoder:
        encoder = self.encoder(on_object=lambda obj: self._object(obj, encoder), share_all=True)
        encoder.on_array = self._sent_array
        return encoder

    def _sent_array(self, array: np.ndarray) -> dict:
        """An array sent with this request: numbered, so that an in-place change made by the
        student's code comes back into it (as it would in one process)."""
        self.arrays.append(array)
        return {"i": len(self.arrays) - 1}

    def _object(self, obj: Any, encoder: wire.Encoder) -> dict:
        handle = obj.__dict__.get("_remote_handle") if isinstance(obj, type) else getattr(obj, "_remote_handle", None)
        if isinstance(handle, str) and self.proxies.get(handle) is obj:
            return {"$": "ref", "h": handle}
        if isinstance(obj, nn.Module):
            return self._send_module(obj, encoder)
        module = type(obj).__module__ or ""
        if module.startswith("attention_lab.") and not module.startswith("attention_lab.bridge") \
                and not isinstance(obj, type) and isinstance(getattr(obj, "__dict__", None), dict):
            return self._send_course_object(obj, encoder)
        if isinstance(obj, torch.utils.data.DataLoader):
            return _send_loader(obj, encoder)
        if isinstance(obj, torch.Generator):
            return {"$": "torch_generator", "state": encoder.encode(obj.get_state())}
        if isinstance(obj, np.random.Generator):  # sent as its state; its new state comes back
            self.generators.append(obj)
            return {"$": "npgenerator", "i": len(self.generators) - 1, "bits": type(obj.bit_generator).__name__,
                    "state": encoder.encode(obj.bit_generator.state)}
        raise wire.WireError(f"the grader cannot send {type(obj).__name__} to the kernel")

    def _send_course_object(self, obj: Any, encoder: wire.Encoder) -> dict:
        """An object of a course class (a check's configuration, its reference cache): sent as its
        state, rebuilt in the kernel from the course's own class; the state the student's code leaves
        it in comes back after the request (its tensors are shared memory, as any)."""
        known = self.sent_objects.get(id(obj))
        object_id = known[0] if known is not None and known[1] is obj else self.new_id()
        self.sent_objects[id(obj)] = (object_id, obj)
        self.request_objects[object_id] = obj
        return {"$": "course_object", "h": object_id, "class": [type(obj).__module__, type(obj).__qualname__],
                "state": encoder.encode({name: value for name, value in vars(obj).items()})}

    def _apply_object_states(self, states: Any, decoder: wire.Decoder) -> None:
        """The fields the student's code left the course objects it was given with: set on ours where the
        call may write them, else kept beside them (:attr:`left`) when they differ."""
        if not isinstance(states, list):
            raise wire.WireError("malformed object states")
        for item in states:
            if not (isinstance(item, list) and len(item) == 2 and item[0] in self.request_objects):
                raise wire.WireError("a state for an unknown object")
            state = decoder.decode(item[1])
            if not isinstance(state, dict) or not all(isinstance(k, str) and k.isidentifier() for k in state):
                raise wire.WireError("a malformed object state")
            obj = self.request_objects[item[0]]
            if id(obj) in self.writable()[0]:
                vars(obj).update(state)
            elif not _same_fields(state, vars(obj)):
                self.left.objects[id(obj)] = state

    def _send_module(self, module: nn.Module, encoder: wire.Encoder) -> dict:
        known = self.sent_modules.get(id(module))
        if known is not None and known[1] is module:
            return {"$": "ref", "h": known[0]}
        if not modules.is_sendable_class(type(module)):
            raise wire.WireError(f"the grader can send only PyTorch's and the course's modules, not {type(module).__name__}")
        module_id = self.new_id()
        self.sent_modules[id(module)] = (module_id, module)
        state = modules.state(module, lambda v: self._share_or_encode(v, encoder))
        self.synced[module_id] = modules.fingerprint(module, self.sid_of)  # (its tensors are shared now)
        return {"$": "cmodule", "h": module_id, "class": modules.torch_class_name(type(module)), "state": state}

    def _share_or_encode(self, value: Any, encoder: wire.Encoder) -> Any:
        return self.share(value, encoder) if isinstance(value, torch.Tensor) else encoder.encode(value)

    def _synced_modules(self) -> Iterable[tuple[str, nn.Module]]:
        for handle, proxy in self.proxies.items():
            if isinstance(proxy, nn.Module):
                yield handle, proxy
        yield from self.sent_modules.values()

    def _module_changes(self, encoder: wire.Encoder) -> list:
        changed = []
        for module_id, module in list(self._synced_modules()):
            current = modules.fingerprint(module, self.sid_of)
            if current != self.synced.get(module_id):
                self.synced[module_id] = current
                changed.append([module_id, modules.state(module, lambda v: self._share_or_encode(v, encoder))])
        return changed

    # -- incoming values ---------------------------------------------------------------
    def _tagged(self, tag: str, fields: dict) -> Any:
        handle = fields.get("h")
        if tag == "ref":  # the kernel handing back one of the checker's own modules or objects
            for object_id, obj in (*self.sent_modules.values(), *self.sent_objects.values()):
                if object_id == handle:
                    return obj
            raise wire.WireError("a reference to an unknown object")
        if not isinstance(handle, str) or not handle.startswith("k") or len(handle) > 24:
            raise wire.WireError("a malformed handle")
        if handle in self.proxies:
            proxy = self.proxies[handle]
            if tag == "module" and "state" in fields and isinstance(proxy, nn.Module):
                self._apply_state(handle, proxy, fields["state"])
            return proxy
        if tag == "module":
            proxy = self._new_module(handle, fields)
        elif tag == "class":
            proxy = _class_proxy(self, handle, fields)
        elif tag == "function":
            proxy = RemoteCallable(self, handle, fields)
        elif tag == "object":
            proxy = _object_proxy(self, handle, fields)
        else:
            raise wire.WireError(f"an unknown tag {tag[:20]!r}")
        self.proxies[handle] = proxy
        return proxy

    def _new_module(self, handle: str, fields: dict) -> nn.Module:
        torch_names = fields.get("torch")
        if not isinstance(torch_names, list) or not torch_names:
            raise wire.WireError("a module without its PyTorch classes")
        if fields.get("builtin") is True:
            module = modules.empty_instance(modules.torch_module_class(torch_names[0]))
        else:
            base = modules.torch_module_class(torch_names[0])
            # the proxy of the student's class as a base too: isinstance(module, TheirClass) holds
            class_proxy = self._current_decoder.decode(fields["class_handle"]) if fields.get("class_handle") else None
            if isinstance(class_proxy, RemoteClassMeta) and issubclass(class_proxy, nn.Module):
                base = class_proxy
            name = str(fields.get("class", "Module")).rsplit(".", 1)[-1][:100]
            members = {"__module__": "student"}
            forward = _signature(fields.get("forward"))
            if forward is not None:  # how the student's forward names its arguments (messages use them)
                def forward_method(self, *args, **kwargs):
                    return RemoteModule.forward(self, *args, **kwargs)
                self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
                forward_method.__signature__ = forward.replace(parameters=[self_parameter, *forward.parameters.values()])
                members["forward"] = forward_method
            cls = type(name if name.isidentifier() else "Module",
                       (RemoteModule,) if base is nn.Module else (RemoteModule, base), members)
            module = modules.empty_instance(cls)
            object.__setattr__(module, "_remote_class_handle", _handle_of(class_proxy))
        object.__setattr__(module, "_remote_handle", handle)
        object.__setattr__(module, "_remote_bridge", self)
        self.proxies[handle] = module
        self._apply_state(handle, module, fields.get("state"))
        return module

    def _apply_state(self, handle: str, module: nn.Module, state: Any) -> None:
        modules.apply_state(module, state, self._current_decoder.decode)
        self.synced[handle] = modules.fingerprint(module, self.sid_of)

    def _apply_module_changes(self, changes: Any, decoder: wire.Decoder) -> None:
        """The state of the student's modules, mirrored; of the checker's own, set where the call may
        write them, else kept beside them (:attr:`left`: a stand-in of its class in that state)."""
        self._current_decoder = decoder
        if not isinstance(changes, list):
            raise wire.WireError("malformed module changes")
        sent = {module_id: module for module_id, module in self.sent_modules.values()}
        for item in changes:
            if not (isinstance(item, list) and len(item) == 2):
                continue
            if isinstance(self.proxies.get(item[0]), nn.Module):
                self._apply_state(item[0], self.proxies[item[0]], item[1])
            elif item[0] in sent:  # one of the checker's own modules
                module = sent[item[0]]
                if id(module) in self.writable()[0]:
                    self._apply_state(item[0], module, item[1])
                else:
                    stand_in = modules.empty_instance(type(module))
                    modules.apply_state(stand_in, item[1], decoder.decode)
                    self.left.modules[id(module)] = stand_in
            # (else one not yet received: its state comes with it)

    def decoder(self, buffers: list[bytes], on_tagged) -> wire.Decoder:
        decoder = super().decoder(buffers, on_tagged)
        self._current_decoder = decoder
        return decoder

    # -- what the checks do ------------------------------------------------------------
    def lookup(self, names: Sequence[str]) -> dict[str, Any]:
        """The notebook's values of ``names`` (those the notebook defines)."""
        reply, decoder = self.request({"op": "lookup", "names": list(names)})
        values = reply.get("values")
        if not isinstance(values, list) or len(values) != len(names):
            raise BridgeError("your notebook's kernel answered a lookup with the wrong number of values")
        found = {}
        for name, item in zip(names, values):
            if not isinstance(item, dict) or item.get("missing"):
                continue
            try:
                found[name] = self.value_of(item, decoder, name)
            except StudentException as error:
                found[name] = _Unreadable(name, error)
            handle = _handle_of(found[name])
            if handle is not None:
                self.names.setdefault(handle, name)
        return found

    def getattr(self, handle: str, name: str) -> Any:
        reply, decoder = self.request({"op": "getattr", "target": handle, "name": name})
        if reply.get("missing"):
            raise AttributeError(name)
        return self.value_of(reply, decoder, f"the attribute {name}")

    def deepcopy(self, handle: str) -> Any:
        """A deep copy of the kernel's object, made there (its proxy)."""
        reply, decoder = self.request({"op": "deepcopy", "target": handle})
        return self.value_of(reply, decoder, "a copy of your object")

    def source(self, handle: str) -> str | None:
        reply, _ = self.request({"op": "source", "target": handle})
        source = reply.get("value")
        return source if isinstance(source, str) else None

    def measure(self, handle: str, probe: probes_module.Probe, what: str) -> probes_module.Probe:
        """Have the kernel's copy of ``probe`` measure the kernel's object ``handle`` itself (its code)."""
        self.generators, self.arrays, self.request_objects = [], [], {}
        encoder = self.new_encoder()
        spec = [*probes_module.spec(probe)[:2], encoder.encode(probe.parameters)]
        reply, decoder = self.request({"op": "measure", "target": handle, "probe": spec}, encoder)
        try:
            probe.accept(self.decode(reply.get("findings"), decoder))
        except wire.WireError as error:
            raise BridgeError(f"your notebook's kernel sent a malformed measurement of {what} ({error})") from None
        return probe

    def call(self, handle: str, args: tuple, kwargs: dict, method: str | None = None,
             probes: Sequence[probes_module.Probe] = (), what: str = "the call", writes: Sequence[Any] = ()) -> Any:
        """Call the kernel's object ``handle`` (or its ``method``); its probes' findings are
        accepted into ``probes`` (and the ambient ones) before the result or exception. ``writes``: the
        checker's objects among the arguments that the call may write (see :attr:`writes`)."""
        active = [*probes, *self.ambient]
        self.writes = list(writes)
        self.generators, self.arrays, self.request_objects = [], [], {}
        encoder = self.new_encoder()
        # Gradients cross too: the arguments that require grad and the parameters of the student's
        # modules involved are the inputs of one autograd node here (_RemoteGraph), whose backward
        # asks the kernel for the gradients through the graph it kept.
        graph_inputs = _tensors_requiring_grad((args, kwargs)) if torch.is_grad_enabled() else []
        parameters = self._parameters_involved(handle, args, kwargs) if torch.is_grad_enabled() else []
        encoder.grad_inputs = {id(tensor): index for index, tensor in enumerate(graph_inputs)}
        try:
            header = {"op": "call", "target": handle, "method": method,
                      "args": encoder.encode(tuple(args)), "kwargs": encoder.encode(dict(kwargs)),
                      "probes": [[*probes_module.spec(p)[:2], encoder.encode(p.parameters)] for p in active],
                      "grad": torch.is_grad_enabled(), "random": random_state(encoder),
                      "graph": bool(graph_inputs or parameters), "parameters": [[h, n] for h, n, _ in parameters]}
        except wire.WireError as error:
            raise BridgeError(f"the grader could not send the arguments of {what}: {error}") from None
        try:
            reply, decoder = self.request(header, encoder)
        finally:
            self.writes = []
        findings = reply.get("probes", [])
        if not isinstance(findings, list) or len(findings) != len(active):
            raise BridgeError("your notebook's kernel did not report the grader's measurements")
        for probe, found in zip(active, findings):
            try:
                probe.accept(self.decode(found, decoder))
            except wire.WireError as error:
                raise BridgeError(f"your notebook's kernel sent a malformed measurement ({error})") from None
        set_random_state(reply.get("random"), lambda value: self.decode(value, decoder))
        result = self.value_of(reply, decoder, what)
        if isinstance(reply.get("graph"), str):
            result = _connect_graph(self, reply["graph"], result, [*graph_inputs, *(p for _, _, p in parameters)])
        return result

    def _parameters_involved(self, handle: str, args: tuple, kwargs: dict) -> list[tuple[str, str, torch.Tensor]]:
        """(module handle, name, the mirror's parameter) of every parameter that requires grad of the
        student's modules this call involves: the one called, and those passed to it."""
        involved = [self.proxies.get(handle)] + [value for value in (*args, *kwargs.values()) if isinstance(value, RemoteModule)]
        found, seen = [], set()
        for module in involved:
            if not isinstance(module, RemoteModule) or id(module) in seen:
                continue
            seen.add(id(module))
            for name, parameter in module.named_parameters():
                if parameter.requires_grad:
                    found.append((module._remote_handle, name, parameter))
        return found

    def backward(self, graph: str, gradients: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The gradients of a call's graph inputs, given those of its outputs (computed in the kernel)."""
        encoder = self.new_encoder()
        reply, decoder = self.request({"op": "backward", "graph": graph,
                                       "gradients": encoder.encode(list(gradients))}, encoder)
        found = self.value_of(reply, decoder, "the backward pass of your code")
        if not isinstance(found, list) or not all(g is None or isinstance(g, torch.Tensor) for g in found):
            raise BridgeError("your notebook's kernel sent malformed gradients")
        return found

    def close(self) -> None:
        try:
            self.connection.settimeout(5)
            wire.send_frame(self.connection, {"op": "done"})
        except OSError:
            pass
        self.connection.close()


def _objects_of(value: Any, depth: int = 0) -> list[Any]:
    """``value`` and what it holds (the items of containers, a course object's fields, a module's
    submodules): every object a contract that writes ``value`` lets the call write."""
    found = [value]
    if depth >= wire.MAX_DEPTH:
        return found
    if isinstance(value, nn.Module):
        found += [module for module in value.modules() if module is not value]
    elif isinstance(value, (tuple, list)):
        found += [obj for item in value for obj in _objects_of(item, depth + 1)]
    elif isinstance(value, dict):
        found += [obj for item in value.values() for obj in _objects_of(item, depth + 1)]
    elif (type(value).__module__ or "").startswith("attention_lab.") and isinstance(getattr(value, "__dict__", None), dict):
        found += [obj for item in vars(value).values() for obj in _objects_of(item, depth + 1)]
    return found


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors ``value`` holds (see :func:`_objects_of`; a module's parameters, buffers and plain
    tensor attributes)."""
    tensors = []
    for obj in _objects_of(value):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, nn.Module):
            tensors += [t for t in (*obj._parameters.values(), *obj._buffers.values()) if t is not None]
            tensors += [t for t in vars(obj).values() if isinstance(t, torch.Tensor)]
    return tensors


def _same_fields(left: dict, right: dict) -> bool:
    """Whether two states of a course object hold the same fields and values (tensors by value)."""
    if left.keys() != right.keys():
        return False
    for name, value in left.items():
        other = right[name]
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.shape == other.shape
                    and value.dtype == other.dtype and torch.equal(value, other)):
                return False
        elif isinstance(value, np.ndarray) or isinstance(other, np.ndarray):
            if not np.array_equal(value, other):
                return False
        elif value is not other and value != other:
            return False
    return True


def _handle_of(obj: Any) -> str | None:
    handle = obj.__dict__.get("_remote_handle") if isinstance(obj, type) else getattr(obj, "_remote_handle", None)
    return handle if isinstance(handle, str) and is_remote(obj) else None


def submitted_code(obj: Any) -> tuple[Any, str] | None:
    """(the submitted notebook's code, the name ``obj`` has in it) for a proxy of an object the notebook's
    cells define (by the name the checker looked it, or a module's class, up by); None otherwise."""
    bridge = bridge_of(obj)
    if bridge is None or bridge.submitted is None:
        return None
    name = bridge.names.get(_handle_of(obj))
    if name is None and isinstance(obj, RemoteModule):
        name = bridge.names.get(obj.__dict__.get("_remote_class_handle"))
    return (bridge.submitted, name) if name is not None and bridge.submitted.knows(name) else None


def contradiction(obj: Any, text: str) -> None:
    """Note, for the grading report, that a measurement taken in the student's kernel contradicts what the
    checker read in the submitted code itself (the kernel's copy of the course was rewritten)."""
    bridge = bridge_of(obj)
    if bridge is not None and text not in bridge.contradictions and len(bridge.contradictions) < 20:
        bridge.contradictions.append(text[:500])


def left_behind(obj: Any) -> LeftBehind | None:
    """What the last request of ``obj``'s bridge (a proxy's) left of the checker's objects, or None
    for an object of this process (the lab)."""
    bridge = bridge_of(obj)
    return None if bridge is None else bridge.left


def _tensors_requiring_grad(value: Any, found: list | None = None, depth: int = 0) -> list[torch.Tensor]:
    """The tensors that require grad in nested tuples, lists and dicts, each once, in encoding order."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        if value.requires_grad and not any(value is seen for seen in found):
            found.append(value)
    elif isinstance(value, (tuple, list)) and depth < wire.MAX_DEPTH:
        for item in value:
            _tensors_requiring_grad(item, found, depth + 1)
    elif isinstance(value, dict) and depth < wire.MAX_DEPTH:
        for key, item in value.items():
            _tensors_requiring_grad(key, found, depth + 1)
            _tensors_requiring_grad(item, found, depth + 1)
    return found


def _replace_tensors(value: Any, replacements: list[torch.Tensor], depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return replacements.pop(0)
    if isinstance(value, (tuple, list)) and depth < wire.MAX_DEPTH:
        return type(value)(_replace_tensors(item, replacements, depth + 1) for item in value)
    if isinstance(value, dict) and depth < wire.MAX_DEPTH:
        return {key: _replace_tensors(item, replacements, depth + 1) for key, item in value.items()}
    return value


class _RemoteGraph(torch.autograd.Function):
    """One call of the student's code as a node of the checker's autograd graph: its inputs are the
    call's graph inputs, its outputs the tensors the call returned, its backward the kernel's."""

    @staticmethod
    def forward(ctx, link: "_GraphLink", *inputs: torch.Tensor):
        ctx.link = link
        outputs = tuple(output.view_as(output) for output in link.outputs)
        ctx.mark_non_differentiable(*(o for o in outputs if not (o.is_floating_point() or o.is_complex())))
        return outputs

    @staticmethod
    def backward(ctx, *gradients: torch.Tensor):
        link = ctx.link
        found = link.bridge.backward(link.graph, list(gradients))
        if len(found) != link.inputs:
            raise BridgeError("your notebook's kernel sent gradients for the wrong number of inputs")
        return (None, *found)


class _GraphLink:
    def __init__(self, bridge: Bridge, graph: str, outputs: list[torch.Tensor], inputs: int):
        self.bridge, self.graph, self.outputs, self.inputs = bridge, graph, outputs, inputs


def _connect_graph(bridge: Bridge, graph: str, result: Any, inputs: list[torch.Tensor]) -> Any:
    """``result`` with its tensors made outputs of a :class:`_RemoteGraph` node over ``inputs``."""
    outputs = flat_tensors(result)
    if not outputs or not inputs:
        return result
    connected = list(_RemoteGraph.apply(_GraphLink(bridge, graph, outputs, len(inputs)), *inputs))
    return _replace_tensors(result, connected)


def _send_loader(loader: "torch.utils.data.DataLoader", encoder: wire.Encoder) -> dict:
    """A DataLoader of the checker's over a TensorDataset, as what the kernel needs to rebuild it: its
    tensors, batch size, order (shuffled from its generator's state, or the global one's) and drop_last."""
    from torch.utils.data import RandomSampler, SequentialSampler, TensorDataset

    sampler = loader.sampler
    if not isinstance(loader.dataset, TensorDataset) or loader.num_workers or loader.batch_size is None \
            or not isinstance(sampler, (RandomSampler, SequentialSampler)):
        raise wire.WireError("the grader can send only a DataLoader over a TensorDataset (no workers)")
    generator = getattr(sampler, "generator", None)
    return {"$": "dataloader", "tensors": encoder.encode(tuple(loader.dataset.tensors)),
            "batch_size": int(loader.batch_size), "drop_last": bool(loader.drop_last),
            "shuffle": isinstance(sampler, RandomSampler),
            "generator": None if generator is None else encoder.encode(generator.get_state())}


class _Unreadable:
    """A notebook global whose value could not be read (a property that raised)."""

    def __init__(self, name: str, error: Exception):
        self.name, self.error = name, error

    def __repr__(self) -> str:
        return f"<{self.name}: {type(self.error).__name__}: {self.error}>"


class RemoteNamespace(dict):
    """The notebook's globals, looked up in the kernel on first use (``answer.__globals__``)."""

    def __init__(self, bridge: Bridge):
        super().__init__()
        self._bridge = bridge

    def _fetch(self, name: str) -> bool:
        if not dict.__contains__(self, name):
            found = self._bridge.lookup([name])
            if name not in found:
                return False
            dict.__setitem__(self, name, found[name])
        return True

    def __getitem__(self, name: str) -> Any:
        if not isinstance(name, str) or not self._fetch(name):
            raise KeyError(name)
        return dict.__getitem__(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if isinstance(name, str) and self._fetch(name) else default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._fetch(name)

    def __bool__(self) -> bool:  # a namespace is there, even before anything was fetched from it
        return True


class RemoteObject:
    """An object of the kernel's: attributes and calls are requests."""

    def __init__(self, bridge: Bridge, handle: str, fields: dict):
        object.__setattr__(self, "_remote_bridge", bridge)
        object.__setattr__(self, "_remote_handle", handle)
        object.__setattr__(self, "_remote_type", str(fields.get("type", "object"))[:200])
        object.__setattr__(self, "_remote_callable", fields.get("signature") is not None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._remote_bridge.getattr(self._remote_handle, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote_bridge.call(self._remote_handle, args, kwargs, what=f"calling a {self._remote_type}")

    def __deepcopy__(self, memo: dict) -> Any:
        return self._remote_bridge.deepcopy(self._remote_handle)

    def __repr__(self) -> str:
        return f"<{self._remote_type} in the student's kernel>"


class RemoteCallable(RemoteObject):
    """A function or class of the notebook's (in the kernel)."""

    def __init__(self, bridge: Bridge, handle: str, fields: dict, is_class: bool = False):
        super().__init__(bridge, handle, fields)
        name = fields.get("name")
        object.__setattr__(self, "__name__", name if isinstance(name, str) else self._remote_type)
        object.__setattr__(self, "__qualname__", str(fields.get("qualname") or self.__name__))
        object.__setattr__(self, "__signature__", _signature(fields.get("signature")))
        object.__setattr__(self, "_remote_is_class", is_class)
        object.__setattr__(self, "_remote_module_class", bool(fields.get("module_class")))

    @property
    def __globals__(self) -> RemoteNamespace:
        return _namespace(self._remote_bridge)

    def remote_call(self, args: tuple, kwargs: dict, probes: Sequence[probes_module.Probe] = (),
                    what: str = "the call") -> Any:
        return self._remote_bridge.call(self._remote_handle, args, kwargs, probes=probes, what=what)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remote_call(args, kwargs, what=f"{self.__name__}(...)")

    def __repr__(self) -> str:
        kind = "class" if self._remote_is_class else "function"
        return f"<{kind} {self.__qualname__} (in the student's kernel)>"


class RemoteModule(nn.Module):
    """A module of the student's: its state mirrored here, its forward run in the kernel."""

    _remote_handle: str
    _remote_bridge: Bridge

    def remote_call(self, args: tuple, kwargs: dict, probes: Sequence[probes_module.Probe] = (),
                    what: str = "the call") -> Any:
        return self._remote_bridge.call(self._remote_handle, args, kwargs, probes=probes, what=what)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remote_call(args, kwargs, what=f"{type(self).__name__}(...)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote_bridge.call(self._remote_handle, args, kwargs, method="forward",
                                        what=f"{type(self).__name__}.forward(...)")

    def __deepcopy__(self, memo: dict) -> "RemoteModule":
        return self.__dict__["_remote_bridge"].deepcopy(self.__dict__["_remote_handle"])

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name.startswith("_"):
                raise
        return self.__dict__["_remote_bridge"].getattr(self.__dict__["_remote_handle"], name)


def _dataclass_fields(bridge: Bridge, data: Any) -> dict | None:
    """``__dataclass_fields__`` for a proxy, from the names and defaults the kernel described."""
    if data is None:
        return None
    if not isinstance(data, list):
        raise wire.WireError("malformed dataclass fields")
    fields = {}
    for item in data:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and item[0].isidentifier()):
            raise wire.WireError("malformed dataclass fields")
        empty = isinstance(item[1], dict) and item[1].get("$") == "empty"
        field = dataclasses.field() if empty else dataclasses.field(default=bridge._current_decoder.decode(item[1]))
        field.name, field.type, field._field_type = item[0], Any, dataclasses._FIELD
        fields[item[0]] = field
    return fields


class RemoteClassMeta(type):
    """The metaclass of a student's class as the checker sees it: a real class (``isinstance(cls,
    type)``, ``issubclass(cls, nn.Module)``, a dataclass's fields), whose instances are made in the
    kernel and whose other attributes are looked up there."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.remote_call(args, kwargs, what=f"{cls.__name__}(...)")

    def remote_call(cls, args: tuple, kwargs: dict, probes: Sequence[probes_module.Probe] = (),
                    what: str = "the call") -> Any:
        return cls._remote_bridge.call(cls._remote_handle, args, kwargs, probes=probes, what=what)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return cls.__dict__["_remote_bridge"].getattr(cls.__dict__["_remote_handle"], name)

    @property
    def __globals__(cls) -> RemoteNamespace:
        return _namespace(cls._remote_bridge)

    def __repr__(cls) -> str:
        return f"<class {cls.__qualname__} (in the student's kernel)>"


_metaclasses: dict[type, type] = {}


class _KernelAttribute:
    """A class attribute of a proxied class that its local base also defines (``apply`` of an autograd
    Function): looked up in the kernel, as any other."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, cls: type) -> Any:
        return cls.__dict__["_remote_bridge"].getattr(cls.__dict__["_remote_handle"], self.name)


def _class_proxy(bridge: Bridge, handle: str, fields: dict) -> type:
    torch_names = fields.get("torch") or []
    base = modules.torch_module_class(torch_names[0]) if fields.get("module_class") and torch_names else object
    if fields.get("autograd_function") is True and base is object:  # issubclass(cls, torch.autograd.Function)
        base = torch.autograd.Function
    meta = type(base)
    if meta not in _metaclasses:
        _metaclasses[meta] = RemoteClassMeta if meta is type else \
            type(f"Remote{meta.__name__}", (RemoteClassMeta, meta), {})
    name = fields.get("name") if isinstance(fields.get("name"), str) and fields["name"].isidentifier() else "Class"
    namespace = {"__module__": "student", "__qualname__": str(fields.get("qualname") or name)[:200],
                 "__signature__": _signature(fields.get("signature")), "_remote_handle": handle,
                 "_remote_bridge": bridge}
    if base is torch.autograd.Function:
        namespace.update({attribute: _KernelAttribute(attribute) for attribute in ("apply", "forward", "backward")})
    dataclass_fields = _dataclass_fields(bridge, fields.get("dataclass"))
    if dataclass_fields is not None:
        namespace["__dataclass_fields__"] = dataclass_fields
    return _metaclasses[meta](name, (base,), namespace)


def _object_proxy(bridge: Bridge, handle: str, fields: dict) -> "RemoteObject":
    dataclass_fields = _dataclass_fields(bridge, fields.get("dataclass"))
    if dataclass_fields is None:
        return RemoteObject(bridge, handle, fields)
    name = str(fields.get("type", "object")).rsplit(".", 1)[-1]
    cls = type(name if name.isidentifier() else "Object", (RemoteObject,), {"__dataclass_fields__": dataclass_fields})
    return cls(bridge, handle, fields)


def _namespace(bridge: Bridge) -> "RemoteNamespace":
    namespace = getattr(bridge, "_namespace", None)
    if namespace is None:
        namespace = bridge._namespace = RemoteNamespace(bridge)
    return namespace


def measure(obj: Any, probe: probes_module.Probe, what: str) -> probes_module.Probe:
    """``probe``'s measurement of a proxy's object, taken in the student's kernel."""
    return obj._remote_bridge.measure(obj._remote_handle, probe, what)


def is_remote(obj: Any) -> bool:
    """Whether ``obj`` is a proxy of an object in a student's kernel."""
    return isinstance(obj, (RemoteObject, RemoteModule, RemoteClassMeta))


def remote_call(fn: Any, args: tuple, kwargs: dict, probes: Sequence[probes_module.Probe], what: str,
                writes: Sequence[Any] = ()) -> Any:
    """Call a proxy with probes (``call_student``'s way in); ``writes``: the checker's objects among the
    arguments that the call may write."""
    return fn._remote_bridge.call(fn._remote_handle, args, kwargs, probes=probes, what=what, writes=writes)



def bridge_of(obj: Any) -> Bridge | None:
    return getattr(obj, "_remote_bridge", None) if is_remote(obj) else None
