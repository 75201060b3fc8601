"""The `inductor` backend: delegates compiled by Inductor at load, results equal eager's.

Inductor on the CPU compiles C++ (tens of seconds on CI's two cores): the tests share a few
small programs."""

import dataclasses
import warnings

import pytest
import torch

import ferry
from edits import edited
from ferry.errors import ProgramError
from ferry.program import load_program, program_to_bytes
from ferry.program.schema import DelegateCall


class Block(torch.nn.Module):
    """Attention kept whole, a norm, an MLP: what Inductor fuses around a fused kernel."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.norm, self.qkv = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 3 * dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.norm(x)).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + y
        return x + self.down(torch.softmax(self.up(x), dim=-1))


SHAPE = (2, 8, 32)


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return Block().eval()


@pytest.fixture(scope="module")
def inductor_program(block):
    ep = torch.export.export(block, (torch.randn(SHAPE),))
    return ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))


def matches_eager(module, model, calls=3):
    for _ in range(calls):
        x = torch.randn(SHAPE)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


def test_an_inductor_delegate_equals_eager_and_plans_nothing_inside(inductor_program, block, tmp_path):
    assert [d.backend_id for d in inductor_program.delegates] == ["inductor"]
    inner = load_program(inductor_program.segments[inductor_program.delegates[0].payload], segments=inductor_program.segments).method("forward")
    kernels = [i.kernel for i in inner.instructions]
    assert "aten::scaled_dot_product_attention.default" in kernels  # the graph Inductor gets keeps it whole
    assert not any(k.endswith(".out") for k in kernels) and len(inner.buffers) <= 1  # functional, unplanned
    path = tmp_path / "block.ferry"
    inductor_program.save(path)
    module = ferry.Module(path)
    matches_eager(module, block)
    module.close()


class Mixed:
    """softmax on the CPU between two delegates: the first compiled by Inductor, the second op by op."""

    def partition(self, ep):
        parts = ferry.OpSupportPartitioner("cpu", exclude=["aten.softmax"]).partition(ep)
        return [ferry.Partition(p.nodes, p.compile_specs, "inductor" if i == 0 else "torch") for i, p in enumerate(parts)]


def test_inductor_and_torch_delegates_mix_in_one_program_with_a_cpu_op_between(block):
    program = ferry.compile(torch.export.export(block, (torch.randn(SHAPE),)), Mixed())
    assert [d.backend_id for d in program.delegates] == ["inductor", "torch"]
    top = [getattr(i, "kernel", "delegate") for i in program.method("forward").instructions]
    assert any("softmax" in k for k in top)
    matches_eager(ferry.Module(program), block)


@pytest.fixture(scope="module")
def mixed_program(block):
    return ferry.compile(torch.export.export(block, (torch.randn(SHAPE),)), Mixed())


def _delegate_calls(m):
    return [i for i in m.instructions if isinstance(i, DelegateCall)]


def test_an_inductor_delegate_returns_its_results_and_the_method_plans_none_for_them(mixed_program, block):
    m = mixed_program.method("forward")
    inductor, op_by_op = ({m.tensor(o).storage for o in d.outputs} for d in _delegate_calls(m))
    assert inductor == {"runtime"} and op_by_op <= {"planned", "output"}
    assert "delegate 0 (inductor)" in m.runtime_allocating_ops  # what inspect lists as allocated per call
    matches_eager(ferry.Module(mixed_program), block)


def _with_outputs_stored(program, delegate: int, storages):
    m = program.method("forward")
    outs = _delegate_calls(m)[delegate].outputs
    values = list(m.values)
    for o, storage in zip(outs, storages):
        values[o] = dataclasses.replace(values[o], storage=storage, plan=None)
    return dataclasses.replace(program, methods={"forward": dataclasses.replace(m, values=values)})


@pytest.mark.parametrize("delegate, storages, refusal", [
    (1, ["runtime"], "writes into memory it is given"),  # the torch backend returns nothing
    (0, ["runtime", "output"], "results it returns .runtime, beside the state it updates.; not ..output., .runtime.."),
])
def test_a_program_that_misstates_who_makes_a_delegates_outputs_is_refused(mixed_program, delegate, storages,
                                                                           refusal, tmp_path):
    path = tmp_path / "hostile.ferry"
    with pytest.raises(ProgramError, match=refusal):  # saving checks the dataflow too
        _with_outputs_stored(mixed_program, delegate, storages).save(path)
        ferry.Module(path).load_method()


def test_a_delegate_returning_what_the_program_does_not_declare_is_an_error_and_the_module_recovers(
        mixed_program, block, monkeypatch):
    from ferry.backends import inductor

    module = ferry.Module(mixed_program)
    module.load_method()
    execute = inductor._Compiled.execute
    monkeypatch.setattr(inductor._Compiled, "execute", lambda self, i, o: [r[:1] for r in execute(self, i, o)])
    with pytest.raises(ferry.BackendError, match="declares"):
        module(torch.randn(SHAPE))
    monkeypatch.setattr(inductor._Compiled, "execute", execute)
    matches_eager(module, block)


def test_a_result_laid_out_otherwise_than_declared_is_copied_to_the_declared_layout(inductor_program, block,
                                                                                       monkeypatch):
    """Compiled code on another device may lay a result out its own way; what reads it next
    (a copy to another device, a view, the caller) gets the declared layout."""
    from ferry.backends import inductor

    execute = inductor._Compiled.execute
    monkeypatch.setattr(inductor._Compiled, "execute", lambda self, i, o: [
        r.transpose(0, 1).contiguous().transpose(0, 1) for r in execute(self, i, o)])  # same values, permuted
    module = ferry.Module(inductor_program)
    x = torch.randn(SHAPE)
    got = module(x)
    assert got.is_contiguous()  # the block's output is declared contiguous
    with torch.no_grad():
        torch.testing.assert_close(got, block(x), rtol=1e-4, atol=1e-5)


class ReturnsViews(torch.nn.Module):
    """An inductor delegate whose results are views of its input and of its weight."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = torch.sin(x)  # on the CPU, outside the delegate: planned
        return h.reshape(-1), self.w.reshape(-1), torch.sin(h.reshape(-1) * 2) + x


def test_results_that_are_views_of_the_delegates_inputs_or_weights_are_the_callers_own(tmp_path):
    model = ReturnsViews().eval()
    part = ferry.OpSupportPartitioner("cpu", exclude=["aten.sin"], backend_id="inductor")
    path = tmp_path / "views.ferry"
    ferry.compile(torch.export.export(model, (torch.randn(16),)), part).save(path)
    module = ferry.Module(path)  # its weights map the file read-only: a write into them would crash
    x1, x2 = torch.randn(16), torch.randn(16)
    first, weight, _ = module(x1)
    second = module(x2)
    torch.testing.assert_close(first, torch.sin(x1))  # not overwritten by the next call's plan
    weight.zero_()  # the caller's tensor, not the program's weight
    for got, want in zip(module(x2), model(x2)):
        torch.testing.assert_close(got, want.detach())
    assert second[0].data_ptr() != first.data_ptr()


def _on_emu_with_device_io(model, *args):
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
        skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
    ep = torch.export.export(model, args)
    return ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", backend_id="inductor"), cfg))


class Transposed(torch.nn.Module):
    def forward(self, x):
        return x.t(), x.sin()


def test_a_result_that_is_a_view_of_an_emulated_input_is_copied_into_emulated_memory(emu):
    """Compiled code returns a view of its input; the copy that makes it the caller's own stays
    on the program's device, where the program says its output is."""
    module = _on_emu_with_device_io(Transposed(), torch.randn(3, 5))
    x = torch.randn(3, 5)
    xe = ferry.runtime.clone_to(x, "emu:0")
    got = module(xe)
    for g, want in zip(got, (x.t(), x.sin())):
        assert ferry.runtime.device_of(g) == ferry.Device.parse("emu:0")
        torch.testing.assert_close(ferry.runtime.clone_to(g, "cpu"), want)
    assert got[0].data_ptr() != xe.data_ptr()


class ValueChecked(torch.nn.Module):
    """Kernels that check their inputs' values: probabilities in [0, 1], a positive-definite
    matrix, pivots that count from 1."""

    def forward(self, p, a, lu, pivots):
        return (torch.bernoulli(p), torch.linalg.cholesky(a @ a.mT + 4 * torch.eye(a.shape[-1])),
                torch.linalg.cholesky(a), *torch.lu_unpack(lu, pivots))


def test_kernels_that_check_values_load_whatever_the_scratch_values_are(emu):
    """The load's dry run feeds scratch values; a kernel refusing them (a scratch matrix that is
    not positive-definite) is the values' doing, not the graph's: the load goes on, and the
    calls equal eager's."""
    torch.manual_seed(0)
    module = None
    for _ in range(2):
        p = torch.randint(0, 2, (6,)).float()  # 0 or 1: bernoulli is deterministic
        a = torch.randn(2, 4, 4)
        pd = a @ a.mT + 4 * torch.eye(4)
        args = (p, pd, *torch.linalg.lu_factor(torch.randn(3, 3)))
        module = module or _on_emu_with_device_io(ValueChecked(), *args)
        got = module(*(ferry.runtime.clone_to(t, "emu:0") for t in args))
        for g, want in zip(got, ValueChecked()(*args)):
            torch.testing.assert_close(ferry.runtime.clone_to(g, "cpu"), want)


class PivotsAndRows(torch.nn.Module):
    """LAPACK's pivots (count from 1) beside an index into a one-row table (only 0 is in range),
    in one graph (their results summed)."""

    def forward(self, lu, pivots, rows, table):
        return torch.lu_unpack(lu, pivots)[1].sum() + torch.nn.functional.embedding(rows, table).sum() * 2


@pytest.mark.parametrize("one_try", [False, True], ids=["second try allowed", "one try, as on CUDA"])
def test_scratch_integers_are_in_range_for_each_input_at_the_first_try(emu, monkeypatch, one_try):
    """The load runs the graph on scratch values; on CUDA a kernel's check of its integers is a
    device-side assert that ends the process's CUDA context (lu_unpack on zero pivots did, and
    every later CUDA test failed), so the scratch integers must suit every input at once: pivots
    1, indices 0 (all 0 fails the pivots, all 1 the index)."""
    from ferry.backends import inductor
    if one_try:
        monkeypatch.setattr(inductor, "ASSERTS_ON_DEVICE", inductor.ASSERTS_ON_DEVICE | {"emu"})
    fills = []
    real = inductor._example
    monkeypatch.setattr(inductor, "_example", lambda v, integers=0: fills.append(integers) or real(v, integers))
    torch.manual_seed(0)
    module = None
    for _ in range(2):
        lu, pivots = torch.linalg.lu_factor(torch.randn(4, 4))
        args = (lu, pivots, torch.zeros(3, dtype=torch.long), torch.randn(1, 5))
        module = module or _on_emu_with_device_io(PivotsAndRows(), *args)
        got = module(*(ferry.runtime.clone_to(t, "emu:0") for t in args))
        torch.testing.assert_close(ferry.runtime.clone_to(got, "cpu"), PivotsAndRows()(*args))
    assert fills == [0, 1, 0, 0]  # one graph, one try: lu, pivots, rows, table


class Cholesky(torch.nn.Module):
    def forward(self, a):
        return torch.linalg.cholesky(a).reshape(-1) * 2


def test_a_view_past_its_storage_after_a_value_checking_kernel_is_still_refused_at_load():
    """The dry run goes on past a kernel that refused the scratch values, with stand-ins of its
    results: a view of one later in the graph is still checked against its storage."""
    from ferry.program.schema import ConstValue, KernelCall, TensorValue

    program = ferry.compile(torch.export.export(Cholesky(), (torch.eye(4),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))

    def make(m, add):
        chol, mul = m.instructions[0], m.instructions[-1]
        dev = m.values[chol.outputs[0]].device
        wide = add(TensorValue("float32", (16,), dev, storage="view", alias_of=chol.outputs[0]))
        view = KernelCall("aten::as_strided.default", (chol.outputs[0], add(ConstValue("ints", [16])),
                                                       add(ConstValue("ints", [1 << 20])), -1), (wide,))
        return [chol, view, dataclasses.replace(mul, args=(wide, *mul.args[1:]))]

    torch.manual_seed(0)  # scratch values: a random matrix is not positive-definite
    with pytest.raises(ProgramError, match="out of bounds"):
        ferry.Module(_with_instructions(program, make)).load_method()


@pytest.mark.parametrize("graphs", [False, True])
def test_an_inductor_delegate_on_the_asynchronous_device_equals_eager(block, emu_async, graphs):
    """Device work runs after the host moves on; compiled code returns its results to the host
    at once (as CUDA's Python does), so the copy after it finds them (it found None). Simulated
    graphs cannot capture such code: those segments run eagerly, with a warning."""
    program = ferry.compile(torch.export.export(block, (torch.randn(SHAPE),)),
                            ferry.OpSupportPartitioner("emu:0", backend_id="inductor", exclude=["aten.softmax.int"]))
    module = ferry.Module(program, cuda_graphs=graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        matches_eager(module, block, calls=4)


def dynamic_lm():
    from test_device_map import TinyLM

    model = TinyLM(layers=2).eval()
    dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("seq", max=32)}
    return model, torch.export.export(model, (torch.randint(0, 32, (4, 16)),), dynamic_shapes=(dims,))


@pytest.mark.parametrize("placement", ["cpu", "emu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_dynamic_partition_is_compiled_once_for_every_size_within_its_bounds(emu, placement):
    """Inductor compiles the partition with its dynamic dimensions symbolic (a size the host
    computes, `ids.shape[1]`, read inside from the input): every size from 2 to the bound runs
    the same code; a dimension of 1 compiles once more, when first met."""
    from torch._dynamo.utils import counters

    if placement == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, ep = dynamic_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs op by op" warning
        program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu" if placement == "cpu" else f"{placement}:0",
                                                               backend_id="inductor"))
    assert [d.backend_id for d in program.delegates] == ["inductor"]
    module = ferry.Module(program)
    module.load_method()
    before = counters["stats"]["unique_graphs"]
    for shape in [(2, 16), (4, 5), (8, 32), (3, 2), (2, 16), (5, 31)]:
        x = torch.randint(0, 32, shape)
        torch.testing.assert_close(module(x), model(x), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == before  # compiled at load, for all of them
    for shape in [(1, 9), (3, 1)]:
        x = torch.randint(0, 32, shape)
        torch.testing.assert_close(module(x), model(x), atol=1e-4, rtol=1e-4)


def test_a_partition_given_a_size_that_is_no_inputs_dimension_runs_op_by_op_with_a_note():
    class Doubled(torch.nn.Module):
        def forward(self, x):
            return x.repeat(2, 1) + torch.ones(x.shape[0] * 2, x.shape[1])  # the host computes 2 * batch

    model = Doubled()
    ep = torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes=({0: torch.export.Dim("b", min=2, max=16)},))
    with pytest.warns(UserWarning, match="delegate 0 runs op by op .*sizes that are no input's dimension"):
        program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    assert [d.backend_id for d in program.delegates] == ["torch"]
    from ferry.inspect import program_summary

    assert "delegate 0: runs op by op (backend 'torch'), not with 'inductor'" in program_summary(program)
    module = ferry.Module(program)
    for batch in (3, 7):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(module(x), model(x))


def test_a_payload_naming_something_that_is_not_an_operator_is_refused_at_load(inductor_program):
    """A hostile payload cannot name Python callables: kernel names resolve only to operators."""
    d = inductor_program.delegates[0]
    inner = load_program(inductor_program.segments[d.payload], segments=inductor_program.segments)
    m = inner.method("forward")
    bad = dataclasses.replace(m.instructions[0], kernel="builtins::eval")
    m2 = dataclasses.replace(m, instructions=[bad, *m.instructions[1:]])
    segments = list(inductor_program.segments)
    segments[d.payload] = program_to_bytes(ferry.Program({"forward": m2}, [], inner.segments))
    hostile = dataclasses.replace(inductor_program, segments=segments)
    with pytest.raises((ProgramError, ferry.BackendError)):
        ferry.Module(hostile).load_method()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_an_inductor_delegate_on_cuda_equals_eager(block, graphs, full_fp32):
    ep = torch.export.export(block, (torch.randn(SHAPE),))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"))
    module = ferry.Module(program, cuda_graphs=graphs)
    model = Block().eval()
    model.load_state_dict(block.state_dict())
    model = model.cuda()
    for _ in range(4):
        x = torch.randn(SHAPE)
        with torch.no_grad():
            want = model(x.cuda()).cpu()
        torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-5)


class Positions(torch.nn.Module):
    """Factory ops in the middle, as transformers makes position ids and masks: traced on the CPU,
    they record `device=cpu`."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        h = self.lin(x + self.emb(torch.arange(x.shape[1])))
        return h @ h.transpose(1, 2) * mask


def _factory_devices(program) -> dict:
    inner = load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward")
    return {i.kernel: [inner.values[a].value for a in i.args if a >= 0 and getattr(inner.values[a], "kind", "") == "device"]
            for i in inner.instructions if i.kernel.startswith(("aten::arange", "aten::ones"))}


def test_a_factory_inside_a_delegate_makes_its_result_on_the_delegate_device():
    ep = torch.export.export(Positions().eval(), (torch.randn(2, 5, 8),))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"))
    assert _factory_devices(program) == {"aten::arange.default": ["cuda:0"], "aten::ones.default": ["cuda:0"]}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["inductor", "torch"])
def test_factories_inside_a_cuda_delegate_equal_eager(backend, full_fp32):
    torch.manual_seed(0)
    model = Positions().eval()
    ep = torch.export.export(model, (torch.randn(2, 5, 8),))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id=backend)))
    for _ in range(3):
        x = torch.randn(2, 5, 8)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


def test_views_are_rebuilt_as_reshapes_that_a_device_layout_cannot_break(inductor_program):
    """Export records a `view` legal for the CPU trace's layouts; CUDA attention lays its result
    out otherwise, and ViT-B/16 and BERT failed to load with "view size is not compatible"."""
    from ferry.backends.inductor import graph_of
    from ferry.runtime.stages.load import load_memory

    inner = load_program(inductor_program.segments[inductor_program.delegates[0].payload], segments=inductor_program.segments).method("forward")
    views = sum(i.kernel in ("aten::view.default", "aten::_unsafe_view.default") for i in inner.instructions)
    memory = load_memory(load_program(inductor_program.segments[inductor_program.delegates[0].payload], segments=inductor_program.segments).segments,
                         inner, pin_host=False)
    try:
        targets = [n.target for n in graph_of(inner, memory).graph.nodes if n.op == "call_function"]
    finally:
        memory.close()
    assert views > 0 and torch.ops.aten.view.default not in targets
    assert targets.count(torch.ops.aten.reshape.default) >= views


def test_inspect_says_an_inductor_delegate_is_compiled_at_load_and_carries_no_native_code(inductor_program):
    from ferry.inspect import program_json, program_summary

    assert "compiled by Inductor when the program loads (no native code in the file)" in program_summary(inductor_program)
    (d,) = program_json(inductor_program)["delegates"]
    assert d["backend_id"] == "inductor" and d["native_code"] is False


def test_the_cli_compiles_with_the_inductor_backend(tmp_path):
    from ferry.cli import main

    out = tmp_path / "block.ferry"
    assert main(["compile", "ferry.examples:transformer_block", "-o", str(out), "--device", "cpu",
                 "--backend", "inductor"]) == 0
    assert {d.backend_id for d in ferry.load_program(out).delegates} == {"inductor"}


def test_a_delegate_inductor_cannot_compile_runs_op_by_op_with_a_warning(inductor_program, block, monkeypatch):
    def fail(gm, example_inputs, options=None):
        raise RuntimeError("no lowering for this op")

    monkeypatch.setattr(torch._inductor, "compile", fail)
    module = ferry.Module(inductor_program)
    with pytest.warns(RuntimeWarning, match="runs op by op"):
        module.load_method()
    matches_eager(module, block)


# ---- regressions a review found (hostile payloads, layouts)


def _with_instructions(program, make):
    """`program` with its delegate's method rebuilt by `make(method, add_value) -> instructions`."""
    d = program.delegates[0]
    inner = load_program(program.segments[d.payload], segments=program.segments)
    m = inner.method("forward")
    m2 = edited(m, lambda values, add: make(m, add))
    segments = list(program.segments)
    segments[d.payload] = program_to_bytes(ferry.Program({"forward": m2}, [], inner.segments))
    return dataclasses.replace(program, segments=segments)


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_a_payload_that_maps_a_file_is_refused_before_anything_runs(backend, tmp_path):
    """aten::from_file(shared=True) maps any path read-write, creating it: a program could write a
    .pth file and so run code. No program may call it."""
    from ferry.program.schema import ConstValue, KernelCall, TensorValue

    target = tmp_path / "written_by_the_program.pth"
    program = ferry.compile(torch.export.export(Double(), (torch.randn(16),)),
                            ferry.OpSupportPartitioner("cpu", backend_id=backend))

    def make(m, add):
        dev = m.values[0].device
        args = (add(ConstValue("str", str(target))), add(ConstValue("bool", True)), add(ConstValue("int", 32)),
                add(ConstValue("dtype", "uint8")), -1, -1, -1)
        mapped = add(TensorValue("uint8", (32,), dev, storage="runtime"))
        return [KernelCall("aten::from_file.default", args, (mapped,)), *m.instructions]

    with pytest.raises(ProgramError, match="may not call it"):
        ferry.Module(_with_instructions(program, make)).load_method()
    assert not target.exists()


def test_an_inductor_payload_with_a_view_outside_its_input_is_refused_at_load():
    """Compiled code does not check a view's bounds; the load runs the graph once through ATen, which does."""
    from ferry.program.schema import ConstValue, KernelCall, TensorValue

    program = ferry.compile(torch.export.export(Double(), (torch.randn(16),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))

    def make(m, add):
        x, dev = m.inputs[0], m.values[m.inputs[0]].device
        wide = add(TensorValue("float32", (16,), dev, storage="view", alias_of=x))
        call = KernelCall("aten::as_strided.default",
                          (x, add(ConstValue("ints", [16])), add(ConstValue("ints", [1 << 20])), -1), (wide,))
        first = m.instructions[0]
        return [call, dataclasses.replace(first, args=(wide, *first.args[1:]))]

    with pytest.raises(ProgramError, match="out of bounds"):
        ferry.Module(_with_instructions(program, make)).load_method()


def test_an_inductor_payload_with_dynamic_inputs_and_explicit_strides_is_refused_at_load():
    """An `as_strided` view of 16 elements fits an input at its bound of 16, where the load's dry run
    checks it, and reads past the same input called with 4: such a payload never loads."""
    from ferry.program.schema import ConstValue, KernelCall, TensorValue

    ep = torch.export.export(Double(), (torch.randn(16),), dynamic_shapes=({0: torch.export.Dim("n", max=16)},))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    assert [d.backend_id for d in program.delegates] == ["inductor"]

    def make(m, add):
        x, dev = m.inputs[0], m.values[m.inputs[0]].device
        wide = add(TensorValue("float32", (16,), dev, storage="view", alias_of=x, dynamic=(True,)))
        call = KernelCall("aten::as_strided.default",
                          (x, add(ConstValue("ints", [16])), add(ConstValue("ints", [1])), -1), (wide,))
        first = m.instructions[0]
        return [call, dataclasses.replace(first, args=(wide, *first.args[1:]))]

    with pytest.raises(ProgramError, match="explicit strides"):
        ferry.Module(_with_instructions(program, make)).load_method()


class Strided(torch.nn.Module):
    def forward(self, x):
        return x.as_strided((4,), (2,)) + x[:4]


def test_a_dynamic_partition_with_explicit_strides_runs_on_ferrys_own_backend():
    ep = torch.export.export(Strided(), (torch.randn(16),), dynamic_shapes=({0: torch.export.Dim("n", min=8, max=16)},))
    with pytest.warns(UserWarning, match="explicit strides"):
        program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    assert [d.backend_id for d in program.delegates] == ["torch"]
    module = ferry.Module(program)
    for n in (16, 9):
        x = torch.randn(n)
        torch.testing.assert_close(module(x), Strided()(x))


def test_a_dynamic_convolution_stays_with_inductor():
    """A convolution's `stride` is not a layout: only views by explicit strides leave Inductor."""
    model = torch.nn.Conv2d(3, 4, 3, stride=2).eval()
    ep = torch.export.export(model, (torch.randn(2, 3, 9, 9),), dynamic_shapes=({0: torch.export.Dim("b", max=4)},))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    assert [d.backend_id for d in program.delegates] == ["inductor"]


class TransposedIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 3))

    def forward(self, x):
        return (x.transpose(0, 1) * 2 + 1) @ self.w


def test_an_inductor_delegate_given_a_transposed_input_equals_eager():
    model = TransposedIn().eval()
    part = ferry.OpSupportPartitioner("cpu", exclude=["aten.transpose"], backend_id="inductor")
    module = ferry.Module(ferry.compile(torch.export.export(model, (torch.randn(5, 6),)), part))
    for _ in range(3):
        x = torch.randn(5, 6)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


class OnePiece(torch.nn.Module):
    def forward(self, x):
        (only,) = x.split(8, dim=-1)  # a list of one tensor: still a list
        return only * 2 + 1


def test_an_op_returning_a_list_of_one_tensor_is_rebuilt_as_a_list():
    model = OnePiece()
    program = ferry.compile(torch.export.export(model, (torch.randn(3, 8),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    inner = load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward")
    assert any(i.kernel.startswith("aten::split") for i in inner.instructions)
    module = ferry.Module(program)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # compiled, not the op-by-op fallback
        module.load_method()
    for _ in range(2):
        x = torch.randn(3, 8)
        torch.testing.assert_close(module(x), model(x))


# ---------------------------------------------------------------------------------------------
# no text from a file reaches generated source (docs/format.md, "Trust")

# a message that closes the string Inductor's C++ code generator pastes it into and calls system()
# (seen to create the file through torch 2.13's CPU code generation when pasted unchecked)
HOSTILE = 'a"), 0)); system("touch PWNED"); (void)((("b'


def _string_arguments():
    """Every (operator, string argument) of ATen and prims in this process's dispatcher."""
    found = set()
    for s in torch._C._jit_get_all_schemas():
        if s.name.startswith(("aten::", "prims::")):
            found |= {(f"{s.name}.{s.overload_name or 'default'}", a.name) for a in s.arguments if "str" in str(a.type)}
    return sorted(found)


def test_no_string_argument_of_any_operator_passes_hostile_text_to_code_generation():
    from ferry.ops.strings import ASSERT_MESSAGE, safe_text

    arguments = _string_arguments()
    assert len(arguments) > 100 and ("aten::_assert_async.msg", "assert_msg") in arguments
    for op, name in arguments:
        for text in (HOSTILE, "floor\"; x", "ij->ji); f(", "tanh\n"):
            try:
                got = safe_text(op, name, text)
            except ValueError:
                continue
            assert got == ASSERT_MESSAGE, (op, name, text)  # an assert's message: ferry's own words


def test_the_names_and_equations_models_pass_are_allowed():
    from ferry.ops.strings import safe_text

    assert safe_text("aten::gelu.default", "approximate", "tanh") == "tanh"
    assert safe_text("aten::div.Tensor_mode", "rounding_mode", "floor") == "floor"
    assert safe_text("aten::einsum.default", "equation", "bij,bjk->bik") == "bij,bjk->bik"
    assert safe_text("aten::einsum.default", "equation", "...ij->...ji") == "...ij->...ji"


def _assert_payload(program, message):
    """The delegate asserts its input's sum is non-zero, with `message`."""
    from ferry.program.schema import ConstValue, KernelCall, TensorValue

    def make(m, add):
        x, dev = m.inputs[0], m.values[m.inputs[0]].device
        total = add(TensorValue("float32", (), dev, storage="runtime"))
        check = KernelCall("aten::_assert_async.msg", (total, add(ConstValue("str", message))), ())
        return [KernelCall("aten::sum.default", (x, -1), (total,)), check, *m.instructions]

    return _with_instructions(program, make)


def test_an_assert_message_from_a_file_never_reaches_inductor(monkeypatch, tmp_path):
    """The attack of the hardening issue: Inductor's C++ code generator pasted `_assert_async.msg`'s
    message into the kernel source. What Inductor is given carries ferry's own message instead."""
    from ferry.ops.strings import ASSERT_MESSAGE

    seen = []
    monkeypatch.setattr(torch._inductor, "compile", lambda gm, examples, options=None: seen.append(gm) or gm)
    program = ferry.compile(torch.export.export(Double(), (torch.randn(16),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    module = ferry.Module(_assert_payload(program, HOSTILE))
    x = torch.rand(16) + 1  # non-zero: the assert holds
    torch.testing.assert_close(module(x), x * 2)
    (gm,) = seen
    texts = [a for n in gm.graph.nodes for a in n.args if isinstance(a, str)]
    assert texts == [ASSERT_MESSAGE] and HOSTILE not in gm.code


@pytest.mark.parametrize("argument,text", [("rounding_mode", HOSTILE), ("rounding_mode", "ceil")])
def test_a_string_no_allowlist_admits_is_refused_before_inductor_sees_it(monkeypatch, argument, text):
    from ferry.program.schema import ConstValue, KernelCall, TensorValue

    monkeypatch.setattr(torch._inductor, "compile",
                        lambda gm, examples, options=None: pytest.fail("Inductor was reached"))
    program = ferry.compile(torch.export.export(Double(), (torch.randn(16),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))

    def make(m, add):
        x, dev = m.inputs[0], m.values[m.inputs[0]].device
        out = add(TensorValue("float32", (16,), dev, storage="runtime"))
        div = KernelCall("aten::div.Tensor_mode", (x, x, add(ConstValue("str", text))), (out,))
        return [div, *m.instructions]

    with pytest.raises(ProgramError, match="rounding_mode"):
        ferry.Module(_with_instructions(program, make)).load_method()


def test_a_compiled_assert_with_a_hostile_message_runs_no_code(tmp_path, monkeypatch):
    """End to end with Inductor's real C++ code generation: the file the message would create is
    never made, and the program computes what it should."""
    monkeypatch.chdir(tmp_path)
    program = ferry.compile(torch.export.export(Double(), (torch.randn(16),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    module = ferry.Module(_assert_payload(program, HOSTILE))
    x = torch.rand(16) + 1
    torch.testing.assert_close(module(x), x * 2)
    assert not (tmp_path / "PWNED").exists()


class EveryDtype(torch.nn.Module):
    """A constant of every dtype, read as a value, and int64 / int32 ones as index lists
    (Swin's relative position index: a constant inside an index list)."""

    DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool)

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i, dtype in enumerate(self.DTYPES):
            self.register_buffer(f"c{i}", (torch.randn(8, generator=g) * 4).to(dtype))
        self.table = torch.nn.Parameter(torch.randn(16, 8, generator=g))
        self.register_buffer("idx64", torch.randint(0, 16, (24,), generator=g))
        self.register_buffer("idx32", torch.randint(0, 16, (24,), generator=g).int())

    def forward(self, x):
        y = x + sum(getattr(self, f"c{i}").to(x.dtype) for i in range(len(self.DTYPES)))
        return y + self.table[self.idx64].sum(0) + self.table[self.idx32].mean(0)


def test_a_constant_of_every_dtype_survives_the_inductor_rebuild():
    model = EveryDtype().eval()
    ep = torch.export.export(model, (torch.randn(3, 8),))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # compiled, not run op by op after a failure
        module = ferry.Module(ferry.load_program(program.to_bytes()))
        for _ in range(2):
            x = torch.randn(3, 8)
            with torch.no_grad():
                torch.testing.assert_close(module(x), model(x))


def test_an_inductor_program_runs_on_the_emulated_device(emu, tmp_path):
    """CPU Inductor code on emulated device memory: its results are host tensors, copied into the
    device's memory where the program declares them there, so CI runs such programs end to end."""
    model = Block().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(SHAPE),)),
                            ferry.OpSupportPartitioner("emu:0", backend_id="inductor"))
    assert {d.backend_id for d in program.delegates} == {"inductor"}
    program.save(tmp_path / "emu.ferry")
    matches_eager(ferry.Module(tmp_path / "emu.ferry"), model)


def _inductor_options_of_block(graphs: bool, monkeypatch) -> dict:
    """The options Inductor compiled Block's one delegate with (its results checked against eager)."""
    seen = []
    real = torch._inductor.compile
    monkeypatch.setattr(torch._inductor, "compile",
                        lambda gm, examples, options=None: seen.append(options) or real(gm, examples, options=options))
    model = Block().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(SHAPE),)),
                            ferry.OpSupportPartitioner("emu:0", backend_id="inductor"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the emulated device captures no graph)
        matches_eager(ferry.Module(program, cuda_graphs=graphs), model)
    [options] = seen
    return options


@pytest.mark.parametrize("graphs, combo, decode", [(True, True, True), (True, True, False), (False, True, True),
                                                   (True, False, True)])
def test_only_a_decode_step_replayed_as_cuda_graphs_is_compiled_with_its_independent_kernels_launched_together(
        emu, graphs, combo, decode, monkeypatch):
    """Inductor's combo kernels (small independent kernels in one launch) for a decode step's delegate
    (compiled with gemv.TUNING) of static sizes in a plan captured as CUDA graphs; not for one run
    kernel by kernel, nor with COMBO_KERNELS off, nor for any other graph (ConvNeXt-T's layout copies
    made one kernel of 8.9 ms, where they take a few µs apart). The results equal eager's either way."""
    from ferry.backends import inductor
    from ferry.choices import gemv

    if decode:
        monkeypatch.setattr(gemv, "settings", lambda gm, shapes, static: gemv.TUNING)
    monkeypatch.setattr(inductor, "COMBO_KERNELS", combo)
    options = _inductor_options_of_block(graphs, monkeypatch)
    assert options["combo_kernels"] is (graphs and combo and decode)


@pytest.mark.parametrize("reductions", [False, True])
def test_a_decode_step_combines_reductions_too_only_with_combine_reductions(emu, reductions, monkeypatch):
    """With COMBINE_REDUCTIONS a graph compiled with gemv.TUNING (a decode step) asks Inductor to
    combine reductions as well (Qwen3's q and k norms with their rotary and the cache writes), each
    combination kept only where Inductor's timing finds it faster; without, pointwise kernels only.
    The results equal eager's either way."""
    from ferry.backends import inductor
    from ferry.choices import gemv

    monkeypatch.setattr(gemv, "settings", lambda gm, shapes, static: gemv.TUNING)
    monkeypatch.setattr(inductor, "COMBINE_REDUCTIONS", reductions)
    options = _inductor_options_of_block(True, monkeypatch)
    assert options["combo_kernels"] is True and options["coordinate_descent_tuning"] is True
    assert options["combo_kernels_pointwise_only"] is not reductions and options["benchmark_combo_kernel"] is reductions


def test_an_inductor_lacking_a_combo_setting_compiles_without_combo_kernels(monkeypatch):
    """Combo kernels of every kind made a slower decode step (Qwen3): an Inductor that cannot be
    told every setting (pointwise only, ...) compiles without any, and is not handed a key it lacks."""
    from ferry.backends import inductor
    from ferry.choices import gemv

    seen = []
    monkeypatch.setattr(torch._inductor, "compile", lambda gm, examples, options=None: seen.append(options) or gm)
    monkeypatch.setattr(inductor, "tensor_inputs", lambda method: [])  # a graph of no inputs: static
    empty = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    inductor._inductor_compile(empty, [], None, gemv.TUNING, combo=True)
    assert seen[0]["combo_kernels"] is True  # (this Inductor knows every setting)
    monkeypatch.setitem(inductor._DECODE_COMBO_OPTIONS, "combo_kernels_of_a_later_inductor", True)  # a key it lacks
    inductor._inductor_compile(empty, [], None, gemv.TUNING, combo=True)
    assert seen[1]["combo_kernels"] is False and "combo_kernels_of_a_later_inductor" not in seen[1]


@pytest.mark.parametrize("device", ["cuda (as if)", "cpu"])
def test_a_static_gpu_delegates_code_first_runs_at_load_on_scratch_inputs(device, monkeypatch):
    """Inductor tunes a GPU kernel at its first launch (an L2-sized buffer to flush the cache,
    copies of what the kernel writes): for a GPU's delegate that launch is made at load, on the
    examples, so the first call allocates no more than later ones. Inductor's C++ code is not
    tuned so: a CPU delegate is not run at load. The results are eager's either way."""
    from ferry.backends import inductor

    monkeypatch.setattr(inductor, "_tunes_at_first_launch", lambda method: device != "cpu")
    runs = []
    real = torch._inductor.compile

    def counted(gm, examples, options=None):
        fn = real(gm, examples, options=options)
        return lambda *args: runs.append(len(args)) or fn(*args)

    monkeypatch.setattr(torch._inductor, "compile", counted)
    model = Block().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(SHAPE),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    module = ferry.Module(program)
    module.load_method()
    at_load = 1 if device != "cpu" else 0
    assert runs == [1] * at_load
    matches_eager(module, model)
    assert runs == [1] * (at_load + 3)


def test_a_first_launch_that_fails_at_load_fails_the_load(monkeypatch):
    """A kernel that fails on the load's examples would fail the first call: the load says so
    (not the op-by-op fallback meant for a graph Inductor cannot compile)."""
    from ferry.backends import inductor

    monkeypatch.setattr(inductor, "_tunes_at_first_launch", lambda method: True)

    def failing(gm, examples, options=None):
        def run(*args):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run

    monkeypatch.setattr(torch._inductor, "compile", failing)
    program = ferry.compile(torch.export.export(Block().eval(), (torch.randn(SHAPE),)),
                            ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ferry.Module(program).load_method()
