"""PropagateDevicePass: give every value a Device and make every transfer an et_copy op.

Decide first, then rewrite once: placement is computed for every value, then exactly one
copy is inserted per (value, destination device) and shared by all consumers that need the
value there. Device-to-device moves are one `_d2d_copy`, never a round trip through the host.
"""

from __future__ import annotations

import operator
from typing import cast

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ferry import node_meta as M
from ferry import ops
from ferry.aot.lower import LoweredBackendModule, is_delegate_node
from ferry.aot.partition import TARGET_DEVICE
from ferry.device import CPU, Device
from ferry.errors import CompileError


def lowered_module_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> LoweredBackendModule:
    """The LoweredBackendModule a call_delegate node calls, or a clear error."""
    arg0 = node.args[0] if node.args else None
    mod = None
    if isinstance(arg0, torch.fx.Node) and arg0.op == "get_attr":
        mod = getattr(gm, cast(str, arg0.target), None)  # a get_attr's target is the attribute name
    if not isinstance(mod, LoweredBackendModule):
        raise CompileError(
            f"call_delegate node {node.name!r}: its first argument must be a get_attr of a LoweredBackendModule, "
            f"got {arg0!r}; build delegates with ferry.to_backend"
        )
    return mod


def delegate_target_device(lowered: LoweredBackendModule) -> Device | None:
    """The device from the `target_device` compile spec; None (CPU, no copies) when absent."""
    raw = lowered.compile_spec(TARGET_DEVICE)
    if raw is None:
        return None
    try:
        text = bytes(raw).decode()
    except UnicodeDecodeError:
        raise ValueError(f"compile spec {TARGET_DEVICE} {raw!r} is not a UTF-8 device string like b'cuda:0'") from None
    return Device.parse(text)


# ops that read a tensor's metadata only (a dynamic size), never its data: no copy to the host
METADATA_OPS = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
                          torch.ops.aten.sym_storage_offset.default})


def _is_tensor(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return val is None or isinstance(val, torch.Tensor)


class PropagateDevicePass(PassBase):
    def __init__(
        self,
        skip_h2d_for_method_inputs: bool = False,
        skip_d2h_for_method_outputs: bool = False,
        enable_non_cpu_memory_planning: bool = True,
    ):
        super().__init__()
        self.state_homes: dict[str, Device] = {}  # state read here, kept where another method updates it
        if not enable_non_cpu_memory_planning and (skip_h2d_for_method_inputs or skip_d2h_for_method_outputs):
            raise CompileError(
                "skip_h2d_for_method_inputs / skip_d2h_for_method_outputs need enable_non_cpu_memory_planning=True: "
                "without device placement there is no device tensor to pass in or out; enable it or drop the skip flag"
            )
        self.skip_h2d = bool(skip_h2d_for_method_inputs)
        self.skip_d2h = bool(skip_d2h_for_method_outputs)
        self.enabled = bool(enable_non_cpu_memory_planning)

    @classmethod
    def for_options(cls, options, state_homes=None) -> PropagateDevicePass:
        """The pass for one method's resolved MethodOptions. `state_homes`: {buffer: device} for
        state this method only reads, where the method updating it keeps it."""
        placer = cls(options.skip_h2d, options.skip_d2h, options.device_placement)
        placer.state_homes = dict(state_homes or {})
        return placer

    # ------------------------------------------------------------------ decide

    def _delegate_devices(self, gm) -> dict[torch.fx.Node, Device | None]:
        return {n: delegate_target_device(lowered_module_of(gm, n)) for n in gm.graph.nodes if is_delegate_node(n)}

    def _consumer_needs(self, consumer, value, targets, home, out_pos=None) -> Device | None:
        """Where `consumer` needs `value`; None when it takes the value wherever it is."""
        if ops.is_copy_node(consumer) or (consumer.target is operator.getitem and is_delegate_node(value)):
            return None
        if consumer.target in METADATA_OPS:
            return None  # reads the tensor's sizes, which the host has wherever its data lives
        if is_delegate_node(consumer):
            return targets[consumer] or CPU
        if consumer.op == "output":
            info = M.output_infos(consumer)[out_pos]
            if info.kind == M.USER_OUTPUT and self.skip_d2h and not home[value].is_cpu:
                return home[value]
            if info.kind == M.BUFFER_MUTATION:
                return self._buffer_home.get(info.target, CPU)  # written back where the buffer lives
            if info.kind == M.USER_INPUT_MUTATION:
                return self._input_home.get(info.target, CPU)  # written into the caller's tensor where it lives
            return CPU
        return CPU

    def _homes(self, gm, targets) -> dict[torch.fx.Node, Device]:
        home: dict[torch.fx.Node, Device] = {}
        self._buffer_home: dict[str, Device] = {}
        self._input_home: dict[str, Device] = {}
        for n in gm.graph.nodes:
            if n.op in ("output",) or (n.op == "get_attr" and isinstance(getattr(gm, n.target, None), LoweredBackendModule)):
                continue
            if is_delegate_node(n):
                home[n] = targets[n] or CPU
            elif n.target is operator.getitem and is_delegate_node(n.args[0]):
                home[n] = home[n.args[0]]
            elif ops.is_copy_node(n):
                home[n] = self._copy_destination(n, targets)
            elif n.op == "placeholder" and M.input_info(n).target in self.state_homes:
                home[n] = self.state_homes[M.input_info(n).target]  # read only here: where its writer keeps it
                self._buffer_home[M.input_info(n).target] = home[n]
            elif n.op == "placeholder" and M.input_info(n).mutable:
                home[n] = self._mutable_buffer_home(gm, n, targets)
                self._buffer_home[M.input_info(n).target] = home[n]
            elif n.op == "placeholder" and self.skip_h2d and M.input_info(n).kind == M.USER_INPUT:
                devs = [targets[u] for u in n.users if is_delegate_node(u) and targets[u] is not None]
                home[n] = devs[0] if devs else CPU
            else:
                home[n] = CPU
            if n.op == "placeholder" and M.input_info(n).kind == M.USER_INPUT:
                self._input_home[n.name] = home[n]
        return home

    def _mutable_buffer_home(self, gm, node, targets) -> Device:
        """A buffer the program updates lives on a device when only delegates on that device read
        it (or nothing reads it) and one of them computes its new value: state such as a KV cache
        then never crosses the host link. Otherwise it lives on the CPU."""
        users = list(node.users)
        if not all(is_delegate_node(u) for u in users):
            return CPU
        readers = {targets[u] for u in users}
        if len(readers) > 1 or None in readers:
            return CPU
        dev = next(iter(readers), None)  # None: never read here, only overwritten
        target = M.input_info(node).target
        out = gm.graph.output_node()
        for info, value in zip(M.output_infos(out), M.flat_outputs(out)):
            if info.kind == M.BUFFER_MUTATION and info.target == target:
                src = value
                if isinstance(src, torch.fx.Node) and ops.is_copy_node(src):  # a copy from an earlier run
                    src = src.args[0]
                produced_on = (isinstance(src, torch.fx.Node) and src.target is operator.getitem
                               and isinstance(src.args[0], torch.fx.Node) and is_delegate_node(src.args[0])
                               and targets[src.args[0]])
                if dev is None:
                    return produced_on or CPU
                return dev if produced_on == dev else CPU
        return CPU

    def _copy_destination(self, node, targets) -> Device:
        recorded = M.get_device(node)
        if recorded is not None:
            return recorded
        if ops.COPY_DIRECTION[node.target] == "d2h":
            return CPU
        devs = [targets[u] for u in node.users if is_delegate_node(u) and targets[u] is not None]
        if not devs:
            raise CompileError(f"copy node {node.name!r} has no recorded device and no device delegate consumer")
        return devs[0]

    # ------------------------------------------------------------------ rewrite

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        targets = self._delegate_devices(gm)
        if not self.enabled:
            return PassResult(gm, self._tag_legacy(gm, targets))
        home = self._homes(gm, targets)

        # every (value, destination) pair that needs a copy, and the uses it serves
        needed: dict[tuple[torch.fx.Node, Device], list[tuple[torch.fx.Node, int | None]]] = {}
        existing = {(n.args[0], home[n]): n for n in gm.graph.nodes if ops.is_copy_node(n)}
        for consumer in gm.graph.nodes:
            uses: list[tuple[int | None, torch.fx.Node]]
            if consumer.op == "output":
                uses = [(i, v) for i, v in enumerate(M.flat_outputs(consumer)) if isinstance(v, torch.fx.Node)]
            else:
                uses = [(None, v) for v in consumer.all_input_nodes]
            for pos, v in uses:
                if v not in home or not _is_tensor(v):
                    continue
                want = self._consumer_needs(consumer, v, targets, home, pos)
                if want is None or want == home[v]:
                    continue
                needed.setdefault((v, want), []).append((consumer, pos))

        modified = False
        for (v, want), served in needed.items():
            copy = existing.get((v, want))
            if copy is None:
                copy = self._insert_copy(gm, v, home[v], want, served[0][0])
                home[copy] = want
            for consumer, pos in served:
                self._redirect(consumer, pos, v, copy)
            modified = True

        for n, dev in home.items():
            if M.get_device(n) != dev:
                M.set_device(n, dev)
                modified = True
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)

    def _insert_copy(self, gm, value, src: Device, dst: Device, first_consumer) -> torch.fx.Node:
        if src.is_cpu:
            direction = "h2d"
        elif dst.is_cpu:
            direction = "d2h"
        else:
            direction = "d2d"
        with gm.graph.inserting_before(first_consumer):
            node = gm.graph.call_function(ops.FUNCTIONAL_COPY_FOR[direction], (value,))
        for key in ("val", "tensor_meta"):
            if key in value.meta:
                node.meta[key] = value.meta[key]
        M.set_device(node, dst)
        return node

    @staticmethod
    def _redirect(consumer, pos, old, new) -> None:
        if consumer.op != "output":
            consumer.replace_input_with(old, new)
            return
        outs = M.flat_outputs(consumer)
        outs[pos] = new
        (orig,) = consumer.args
        consumer.args = (type(orig)(outs) if isinstance(orig, (tuple, list)) else outs[0],)

    def _tag_legacy(self, gm, targets) -> bool:
        """Legacy mode: no copies, and every value lives in host memory, so it is placed on the
        CPU (the reference tags delegate inputs and outputs with the delegate's device although
        its planner then ignores devices; ferry records where the memory is, and nothing later
        decides again). Each delegate moves its own data, as its target_device says."""
        modified = False
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "call_function") and M.get_device(n) != CPU:
                M.set_device(n, CPU)
                modified = True
        return modified
