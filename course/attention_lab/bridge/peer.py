"""What each end of the bridge keeps: the memory both sides see, kept equal at every crossing.

A tensor that crosses keeps being *the same memory* on both sides while a check runs, as it
would in one process: the storage it views gets an id (``sid``) and a copy on the other side;
before either side sends a message it looks for storages it changed since the last crossing
(an answer that wrote into its input in place, a check that changed a weight) and sends their
new bytes with the message; the receiver writes them into its copy.  A tensor sent again, or
one that views a storage already shared (a view of an input, a parameter that is a slice of
another module's weight), travels as (sid, dtype, offset, shape, strides): on the other side it
is a view of the same copy.  So in-place changes, views and shared memory mean there what they
mean here, and the checks that look at them (an input changed in place, ``.view`` returning a
view, a weight that shares memory with the module it was copied from) work unchanged.

Memory is only ever rebuilt from bytes (:mod:`attention_lab.bridge.wire`).
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any, Callable

import numpy as np
import torch

from attention_lab.bridge import wire

MAX_SHARED_BYTES = 512 * 2**20  # what one test cell may share in all (both copies count once)


class Peer:
    """One side of the bridge: its shared storages and how values are encoded and decoded."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._next = 0
        # sid -> (a uint8 tensor over the local storage, a copy of it as of the last crossing)
        self.storages: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.by_pointer: dict[int, str] = {}  # local storage address -> sid
        self.known_to_other: set[str] = set()
        self.shared_bytes = 0
        self.graph_inputs: dict[int, torch.Tensor] = {}  # the current call's autograd inputs, by index
        self.forget_later: list = []  # storages the other side forgot, forgotten before the next message

    def new_id(self) -> str:
        self._next += 1
        return f"{self.prefix}{self._next}"

    # -- storages ----------------------------------------------------------------------
    @staticmethod
    def _pointer(tensor: torch.Tensor) -> int | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return storage.data_ptr() if storage.nbytes() else None

    def sid_of(self, tensor: torch.Tensor) -> str | None:
        pointer = self._pointer(tensor)
        return None if pointer is None else self.by_pointer.get(pointer)

    def _register(self, sid: str, whole: torch.Tensor) -> None:
        self.shared_bytes += whole.numel()
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise wire.WireError(f"more than {MAX_SHARED_BYTES // 2**20} MiB of tensors shared in one test")
        self.storages[sid] = (whole, whole.clone())
        pointer = whole.untyped_storage().data_ptr() if whole.numel() else None
        if pointer is not None:
            self.by_pointer[pointer] = sid

    def share(self, tensor: torch.Tensor, encoder: wire.Encoder) -> dict:
        """``tensor`` encoded as a view of a shared storage (shared now if it was not)."""
        data = wire.sendable(tensor)  # (grading runs on the CPU: a CUDA tensor would be shared as a copy)
        sid = self.sid_of(data)
        fields = wire.tensor_fields(tensor, data)
        if sid is None:
            sid = self.new_id()
            whole = torch.empty(0, dtype=torch.uint8)
            whole.set_(data.untyped_storage())
            self._register(sid, whole)
        fields["sid"] = sid
        graph_index = getattr(encoder, "grad_inputs", {}).get(id(tensor))
        if graph_index is not None:  # an input of the call's autograd graph (see checker_side.Bridge.call)
            fields["grad"], fields["gi"] = True, graph_index
        if sid not in self.known_to_other:
            whole = self.storages[sid][0]
            fields["b"] = encoder._buffer(whole.numpy().tobytes())
            self.known_to_other.add(sid)
        return fields

    def shared_tensor(self, fields: dict, buffers: list[bytes]) -> torch.Tensor:
        """The tensor a message describes as a view of a shared storage (new or known)."""
        sid = fields.get("sid")
        if not isinstance(sid, str) or len(sid) > 24:
            raise wire.WireError("a malformed storage id")
        if sid not in self.storages:
            index = fields.get("b")
            if type(index) is not int or not 0 <= index < len(buffers):
                raise wire.WireError(f"a tensor on an unknown storage {sid}")
            raw = wire.owned(buffers, index)
            whole = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            self._register(sid, whole)
            self.known_to_other.add(sid)
        graph_index = fields.get("gi")
        if type(graph_index) is int and graph_index in self.graph_inputs:
            return self.graph_inputs[graph_index]  # the same input twice (q = k = v = x): one tensor
        tensor = wire.tensor_on(self.storages[sid][0], fields)
        if type(graph_index) is int and 0 <= graph_index < 10_000:
            self.graph_inputs[graph_index] = tensor
        return tensor

    def unused(self) -> list[str]:
        """The shared storages that nothing on this side uses any more (only this bridge's own view
        of them is left): forgotten on both sides, so that no crossing compares them again."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:
            return []
        return [sid for sid, (whole, _) in self.storages.items()
                if whole.numel() and use_count(whole.untyped_storage()._cdata) <= 2]

    def forget(self, sids: Any) -> None:
        if not isinstance(sids, list):
            raise wire.WireError("malformed storages to forget")
        for sid in sids:
            if sid in self.storages:
                whole, _ = self.storages.pop(sid)
                self.shared_bytes -= whole.numel()
                if whole.numel():
                    self.by_pointer.pop(whole.untyped_storage().data_ptr(), None)
            self.known_to_other.discard(sid)

    def changes(self, encoder: wire.Encoder) -> list[list]:
        """[sid, buffer] for every shared storage this side changed since the last crossing."""
        changed = []
        for sid, (whole, snapshot) in self.storages.items():
            if sid in self.known_to_other and not torch.equal(whole, snapshot):
                snapshot.copy_(whole)
                changed.append([sid, encoder._buffer(whole.numpy().tobytes())])
        return changed

    def apply_changes(self, changes: Any, buffers: list[bytes]) -> None:
        if not isinstance(changes, list):
            raise wire.WireError("malformed changes")
        for item in changes:
            if not (isinstance(item, list) and len(item) == 2 and item[0] in self.storages
                    and type(item[1]) is int and 0 <= item[1] < len(buffers)):
                raise wire.WireError("a change to an unknown storage")
            whole, snapshot = self.storages[item[0]]
            raw = buffers[item[1]]
            if len(raw) != whole.numel():
                raise wire.WireError("a change that resizes a storage")
            if not self.takes_change(item[0]):
                self.fork(item[0], wire.owned(buffers, item[1]))
                continue
            with torch.no_grad():
                whole.copy_(torch.frombuffer(wire.owned(buffers, item[1]), dtype=torch.uint8) if raw else whole)
                snapshot.copy_(whole)

    def takes_change(self, sid: str) -> bool:
        """Whether the other side's change of storage ``sid`` is written into this side's memory (else the
        storage is forked: :meth:`fork`)."""
        return True

    def fork(self, sid: str, raw: bytearray) -> torch.Tensor:
        """From now on, ``sid`` names a copy holding the other side's bytes ``raw`` (memory it owns); this
        side's own memory keeps what it held (and, sent again, is shared anew). The copy, a uint8 tensor,
        is returned."""
        whole, _ = self.storages[sid]
        if whole.numel():
            self.by_pointer.pop(whole.untyped_storage().data_ptr(), None)
        self.shared_bytes -= whole.numel()
        copy = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        self._register(sid, copy)
        return copy

    # -- messages ----------------------------------------------------------------------
    def send(self, connection: socket.socket, header: dict, encoder: wire.Encoder) -> None:
        # what this side wrote into a storage it is about to forget (an input the answer changed in
        # place, then dropped) still goes first: the receiver applies changes before it forgets
        header["changes"] = self.changes(encoder)
        header["forget"] = self.unused()
        self.forget(header["forget"])
        wire.send_frame(connection, header, encoder.buffers)

    def receive(self, connection: socket.socket, deadline: float | None = None) -> tuple[dict, list[bytes]]:
        header, buffers = wire.receive_frame(connection, deadline)
        forget = header.get("forget", [])
        if not isinstance(forget, list):
            raise wire.WireError("malformed storages to forget")
        # after this message's values are decoded (they may view those storages), before the next is encoded
        self.forget_later = forget
        self.apply_changes(header.get("changes", []), buffers)
        return header, buffers

    def encoder(self, on_object: Callable[[Any], dict], share_all: bool) -> wire.Encoder:
        """An encoder whose tensors are shared (``share_all``) or sent as plain data unless they view
        memory that is already shared."""
        self.forget(self.forget_later)
        self.forget_later = []
        encoder = wire.Encoder(on_object)

        def on_tensor(tensor: torch.Tensor) -> dict | None:
            if share_all or self.sid_of(wire.sendable(tensor)) is not None:
                return self.share(tensor, encoder)
            return None

        encoder.on_tensor = on_tensor
        return encoder

    def decoder(self, buffers: list[bytes], on_tagged: Callable[[str, dict], Any]) -> wire.Decoder:
        return wire.Decoder(buffers, on_tagged, on_tensor=lambda _tensor, fields: self.shared_tensor(fields, buffers))


# --------------------------------------------------------------------------------------
# What both sides send with every call
# --------------------------------------------------------------------------------------

def random_state(encoder: wire.Encoder) -> dict:
    """This side's global random state (torch's, NumPy's legacy one), sent with a call so that the
    other side draws what one process would draw next. As bytes, not as shared memory."""
    state = np.random.get_state()
    return {"torch": encoder.encode(torch.get_rng_state().numpy().tobytes()),
            "numpy": [encoder.encode(state[1]), int(state[2]), int(state[3]), float(state[4])]}


def set_random_state(fields: Any, decode: Callable[[Any], Any]) -> None:
    """Take the other side's random state (``decode``: its values); a malformed one is ignored."""
    if not isinstance(fields, dict):
        return
    torch_state = decode(fields.get("torch"))
    if isinstance(torch_state, bytes) and torch_state:
        with contextlib.suppress(RuntimeError):
            torch.set_rng_state(torch.frombuffer(bytearray(torch_state), dtype=torch.uint8))
    numpy_state = fields.get("numpy")
    if isinstance(numpy_state, list) and len(numpy_state) == 4:
        keys = decode(numpy_state[0])
        with contextlib.suppress(ValueError, TypeError):
            np.random.set_state(("MT19937", keys, int(numpy_state[1]), int(numpy_state[2]), float(numpy_state[3])))


def flat_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a result (nested tuples, lists, dicts), in the one order both sides use."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and depth < wire.MAX_DEPTH:
        return [t for item in value for t in flat_tensors(item, depth + 1)]
    if isinstance(value, dict) and depth < wire.MAX_DEPTH:
        return [t for item in value.values() for t in flat_tensors(item, depth + 1)]
    return []
