"""ferry.Module: load a program, allocate its planned memory per device, run its methods."""

from __future__ import annotations

import os
import warnings
from typing import Protocol

from ferry.backend_registry import get_backend
from ferry.errors import BackendError, FerryError
from ferry.program import Program, load_program
from ferry.program.schema import MethodMeta
from ferry.runtime.method import LoadedMethod
from ferry.runtime.run import caller_copy


class _DelegateHandle(Protocol):
    """What a backend's init returns (backend_registry.py); the Module frees it with close()."""

    def close(self) -> None: ...


class Module:
    """Runs a ferry Program.

    cuda_graphs=True captures each device segment (the delegates and copies between two host
    instructions) as a CUDA graph after one warm-up call and replays it afterwards. Device
    inputs (skip_h2d) are then copied on the device into fixed tensors each call, and device
    outputs (skip_d2h) come from fixed tensors, so those segments are captured too.

    outputs="copy" (default) returns tensors the caller owns; outputs="view" returns views of
    planned memory, valid until the next call (zero copy). Without CUDA graphs, outputs kept on
    a device by skip_d2h come back as device tensors the caller owns either way.
    """

    def __init__(self, program: Program | str | os.PathLike, *, outputs: str = "copy", pin_host_memory: bool = True,
                 cuda_graphs: bool = False):
        if not isinstance(program, Program):
            program = load_program(program)
        if outputs not in ("copy", "view"):
            raise ValueError(f"outputs must be 'copy' or 'view', got {outputs!r}")
        self.program = program
        self.outputs = outputs
        self.pin_host_memory = pin_host_memory
        self.cuda_graphs = cuda_graphs
        self._methods: dict[str, LoadedMethod] = {}
        self._delegates: dict[int, _DelegateHandle] = {}

    # ---------------------------------------------------------------- load

    def method_names(self) -> list[str]:
        return list(self.program.methods)

    def method_meta(self, name: str = "forward") -> MethodMeta:
        return self.program.method_meta(name)

    def load_method(self, name: str = "forward") -> None:
        """Allocate every planned buffer of `name` on its device; all or nothing."""
        if name in self._methods:
            return
        method = self.program.method(name)
        created: list[int] = []

        def delegate(index: int, memory=()):
            if index not in self._delegates:
                self._delegates[index] = self._init_delegate(index, list(memory))
                created.append(index)
            return self._delegates[index]

        try:
            loaded = LoadedMethod(self.program, method, delegate, pin_host=self.pin_host_memory,
                                  cuda_graphs=self.cuda_graphs)
            for note in loaded.notes:
                warnings.warn(f"method {name!r}: {note}", RuntimeWarning, stacklevel=2)
            self._methods[name] = loaded
        except BaseException:
            for index in created:
                self._delegates.pop(index).close()
            raise

    def _init_delegate(self, index: int, memory: list):
        """`memory`: the delegate's working memory, planned in the method's arenas."""
        d = self.program.delegates[index]
        backend = get_backend(d.backend_id)
        payload = self.program.segments[d.payload]
        try:
            if memory:
                return backend.init(payload, d.compile_specs, memory=memory)
            return backend.init(payload, d.compile_specs)
        except FerryError:
            raise
        except Exception as e:
            raise BackendError(f"backend {d.backend_id!r} failed to initialise delegate {index}: {e}") from e

    # ---------------------------------------------------------------- run

    def run_method(self, name: str, inputs) -> list:
        self.load_method(name)
        m = self._methods[name]
        inputs = list(inputs)
        m.check_inputs(inputs)
        outs = m.execute(inputs)
        devices = m.output_devices
        if self.outputs == "view":
            # a view of a constant would let the caller write into the program (a read-only
            # file mapping: a crash); those few outputs are copies, the rest stay views
            constant = m.constant_outputs
            return [caller_copy(o, devices[i]) if i in constant else o for i, o in enumerate(outs)] if constant else outs
        caller_owned = m.caller_owned_outputs
        return [o if i in caller_owned else caller_copy(o, devices[i]) for i, o in enumerate(outs)]

    def forward(self, *inputs):
        outs = self.run_method("forward", inputs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    __call__ = forward

    def close(self) -> None:
        for m in self._methods.values():
            m.close()
        for d in self._delegates.values():
            d.close()
        self._methods.clear()
        self._delegates.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
