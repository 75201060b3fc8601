"""Caps that hold during a call: a call allocates only results of the sizes its program declares
(runtime/stages/sizes.py holds every kernel to them before it runs), and `max_memory` counts
those sizes at load (program/footprint.py, `call_bytes`).

Hostile programs make a kernel allocate far more than their file declares (a `relu` replaced
by `repeat`, `ones`, `empty`, `new_zeros`, an `expand` then a copy, an out kernel growing
planned memory, in a method or inside a delegate): each is a ferry error before anything of
that size is allocated, never an InputError blaming the caller's tensors."""

import dataclasses

import pytest
import torch

import ferry
from edits import edited
from ferry.errors import AllocationError, InputError, ProgramError
from ferry.program import load_program, program_to_bytes
from ferry.program.footprint import call_bytes, load_bytes
from ferry.program.schema import ConstValue, KernelCall, TensorValue
from ferry.runtime.stages.sizes import check_results, meta_results

HUGE = [1 << 12, 1 << 12]  # rows x columns: 64 MiB of float32, four times the cap below
CAP = "16MiB"


class ReluTimesTwo(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


class Repeated(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x).repeat(1, 2) * 2


def relu_program(partitioner=None):
    """value 0: x (planned), 1: relu (a run-time result), 2: the product; instruction 0 is the relu."""
    return ferry.compile(torch.export.export(ReluTimesTwo(), (torch.randn(4, 8),)), partitioner)


def with_first(p, make):
    """`p` with the first instruction of its method replaced by `make(values, add_value)`."""
    m = p.method("forward")
    m2 = edited(m, lambda values, add: [make(values, add), *m.instructions[1:]])
    return dataclasses.replace(p, methods={"forward": m2})


def ints(add, value):
    return add(ConstValue("ints", list(value)))


def f32(shape, **kw):
    return TensorValue("float32", tuple(shape), storage=kw.pop("storage", "runtime"), **kw)


HOSTILE = {
    "repeat": lambda v, add: KernelCall("aten::repeat.default", (0, ints(add, [HUGE[0] // 4, HUGE[1] // 8])), (1,)),
    "ones": lambda v, add: KernelCall("aten::ones.default", (ints(add, HUGE), -1, -1, -1, -1), (1,)),
    "empty": lambda v, add: KernelCall("aten::empty.memory_format", (ints(add, HUGE), -1, -1, -1, -1, -1), (1,)),
    "new_zeros": lambda v, add: KernelCall("aten::new_zeros.default", (0, ints(add, HUGE), -1, -1, -1, -1), (1,)),
    "full on a device": lambda v, add: KernelCall(
        "aten::full.default", (ints(add, HUGE), add(ConstValue("scalar", 1.0)), -1, -1,
                               add(ConstValue("device", "cpu")), -1), (1,)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_kernel_making_more_than_its_file_declares_is_refused_at_load(case, tmp_path):
    path = tmp_path / "hostile.ferry"
    with_first(relu_program(), HOSTILE[case]).save(path)
    module = ferry.Module(path, max_memory=CAP)
    with pytest.raises(ProgramError, match=r"instruction 0 .*would be float32\[4096, 4096\].*declares float32\[4, 8\]"):
        module.load_method()  # before any call: nothing of that size was ever allocated
    with pytest.raises(ProgramError):  # and a call says the same, never an InputError about x
        module(torch.randn(4, 8))


def with_method(p, make):
    """`p` with its method's instructions `make(method, add_value)`."""
    m = p.method("forward")
    return dataclasses.replace(p, methods={"forward": edited(m, lambda values, add: make(m, add))})


def test_an_expanded_view_then_a_copy_is_refused():
    """`expand` makes a view of any size for free; its copy would allocate it."""
    def make(m, add):
        view = add(f32((4, 8), storage="view", alias_of=0))
        return [KernelCall("aten::expand.default", (0, ints(add, [1024, 4, 8]), add(ConstValue("bool", False))), (view,)),
                KernelCall("aten::clone.default", (view, -1), (1,)), *m.instructions[1:]]

    with pytest.raises(ProgramError, match=r"aten::expand.default.*float32\[1024, 4, 8\]"):
        ferry.Module(with_method(relu_program(), make)).load_method()


def test_an_out_kernel_growing_planned_memory_is_refused():
    """`repeat.out` into the planned product: the kernel would resize planned memory (a new,
    uncounted arena) where the plan says (4, 8)."""
    def make(m, add):
        return [m.instructions[0], KernelCall("aten::repeat.out", (1, ints(add, [64, 64]), 2), (2,))]

    with pytest.raises(ProgramError, match=r"aten::repeat.out.*float32\[256, 512\].*declares float32\[4, 8\]"):
        ferry.Module(with_method(relu_program(), make)).load_method()


def test_a_huge_result_declared_as_it_is_counted_against_the_cap():
    """A file may declare a huge result truthfully: then max_memory counts it at load. The same
    file under a cap that holds it runs, and is the program it says (x repeated, its first rows
    taken, doubled)."""
    rows = 1 << 16

    def make(m, add):
        big = add(f32((rows, 8), name="big"))
        first = add(f32((4, 8), storage="view", alias_of=big))
        return [KernelCall("aten::repeat.default", (0, ints(add, [rows // 4, 1])), (big,)),
                KernelCall("aten::slice.Tensor", (big, add(ConstValue("int", 0)), add(ConstValue("int", 0)),
                                                  add(ConstValue("int", 4)), add(ConstValue("int", 1))), (first,)),
                KernelCall("aten::mul.out", (first, 3, 2), (2,))]

    p = with_method(relu_program(), make)
    x = torch.randn(4, 8)
    big = x.repeat(rows // 4, 1)
    with pytest.raises(AllocationError, match=rf"{big.nbytes:,} of them for a call's results"):
        ferry.Module(p, max_memory="1MiB").load_method()
    torch.testing.assert_close(ferry.Module(p, max_memory="4MiB")(x), big[:4] * 2)


def payload_with(program, make):
    """`program` with its delegate's method rebuilt by `make(method, index of its relu, add_value)`."""
    d = program.delegates[0]
    inner = load_program(program.segments[d.payload], segments=program.segments)
    m = inner.method("forward")
    relu = next(i for i, ins in enumerate(m.instructions) if ins.kernel == "aten::relu.default")
    m2 = edited(m, lambda values, add: make(m, relu, add))
    segments = list(program.segments)
    shared = d.backend_id == "torch"  # its weights are the program's segments
    segments[d.payload] = program_to_bytes(ferry.Program({"forward": m2}, [], program.segments if shared
                                                         else inner.segments), with_segments=not shared)
    return dataclasses.replace(program, segments=segments)


def test_a_hostile_kernel_inside_a_delegate_is_refused_and_nothing_stays_allocated(emu):
    program = relu_program(ferry.OpSupportPartitioner("emu:0"))

    def make(m, relu, add):
        (src,), (out,) = m.instructions[relu].args, m.instructions[relu].outputs
        return [*m.instructions[:relu], KernelCall("aten::repeat.default", (src, ints(add, [1024, 512])), (out,)),
                *m.instructions[relu + 1:]]

    module = ferry.Module(payload_with(program, make), max_memory=CAP)
    with pytest.raises(ProgramError, match=r"aten::repeat.default.*would be float32\[4096, 4096\]"):
        module.load_method()
    assert emu.live_bytes == 0  # the failed load freed what it had allocated
    x = torch.randn(4, 8)
    torch.testing.assert_close(ferry.Module(program, max_memory=CAP)(x), torch.relu(x) * 2)  # the real one runs


def test_a_hostile_kernel_inside_an_inductor_delegate_is_refused_before_its_dry_run():
    program = relu_program(ferry.OpSupportPartitioner("cpu", backend_id="inductor"))

    def make(m, relu, add):
        (src,), (out,) = m.instructions[relu].args, m.instructions[relu].outputs
        ones = KernelCall("aten::new_ones.default", (src, ints(add, HUGE), -1, -1, -1, -1), (out,))
        return [*m.instructions[:relu], ones, *m.instructions[relu + 1:]]

    with pytest.raises(ProgramError, match=r"aten::new_ones.default.*float32\[4096, 4096\]"):
        ferry.Module(payload_with(program, make), max_memory=CAP).load_method()


def dynamic_repeated():
    """x: (b <= 64, 8) -> relu (b, 8) -> repeat(1, 2) (b, 16) -> doubled: instruction 1 repeats."""
    ep = torch.export.export(Repeated(), (torch.randn(4, 8),), dynamic_shapes={"x": {0: torch.export.Dim("b", max=64)}})
    return ferry.compile(ep)


def test_a_call_whose_sizes_break_the_declared_bounds_is_refused_before_the_kernel_runs():
    """Only a call knows a dynamic size: the hostile `repeat(2, 2)` fits the declared bound
    (64 rows) while b <= 32, and beyond it is a ProgramError before the kernel runs, not an
    InputError: the caller's x is within its bounds. The module keeps serving calls that fit."""
    p = dynamic_repeated()
    m = p.method("forward")
    assert m.instructions[1].kernel == "aten::repeat.default"
    values = list(m.values)
    values[m.instructions[1].args[1]] = ConstValue("ints", [2, 2])
    module = ferry.Module(dataclasses.replace(p, methods={"forward": dataclasses.replace(m, values=values)}))
    for b in (4, 40, 32, 40, 3):
        x = torch.randn(b, 8)
        if 2 * b > 64:
            with pytest.raises(ProgramError, match=rf"would be float32\[{2 * b}, 16\].*bounds") as info:
                module(x)
            assert not isinstance(info.value, InputError)
        else:
            torch.testing.assert_close(module(x), torch.relu(x).repeat(2, 2) * 2)


def test_a_dynamic_programs_call_time_bytes_are_counted_at_load():
    """relu and repeat allocate their results during a call: at the bound (64 rows) both are
    alive at once. A budget one byte short of loading plus that is refused at load; one that
    holds it runs every size, equal to eager."""
    p = dynamic_repeated()
    m = p.method("forward")
    bound = torch.randn(64, 8)
    relu = torch.relu(bound)
    peak = relu.nbytes + relu.repeat(1, 2).nbytes  # what eager holds at once at the bound
    assert call_bytes(p, m) == {ferry.Device("cpu"): peak}
    total = load_bytes(p, m)[ferry.Device("cpu")] + peak
    with pytest.raises(AllocationError, match=rf"needs {total:,} bytes on cpu:0, {peak:,} of them for a call"):
        ferry.Module(p, max_memory=total - 1).load_method()
    module = ferry.Module(p, max_memory=total)
    for b in (64, 3, 17, 64):
        x = torch.randn(b, 8)
        torch.testing.assert_close(module(x), Repeated()(x))


def test_meta_sizing_allocates_nothing_and_says_when_it_cannot():
    """A factory op told to make 1 TiB on the CPU is sized, not run; an op with no meta kernel
    answers why (and a result declared of that op is refused)."""
    huge = [1 << 20, 1 << 18]
    results = meta_results(torch.ops.aten.ones.default, [huge], {"device": torch.device("cpu")})
    assert results == ((tuple(huge), torch.float32),)
    why = meta_results(torch.ops.aten.nonzero.default, [torch.randn(4)], {})
    assert isinstance(why, str) and why
    with pytest.raises(ProgramError, match="cannot tell the size"):
        check_results(torch.ops.aten.nonzero.default, why, [f32((4, 1))], "instruction 0")


@pytest.mark.parametrize("op, args", [
    (torch.ops.aten.geqrf.default, (torch.randn(5, 3),)),
    (torch.ops.aten.geqrf.default, (torch.randn(2, 3, 4),)),
    (torch.ops.aten.histogram.bin_ct, (torch.randn(20), 7)),
    (torch.ops.aten.histogram.bins_tensor, (torch.randn(20), torch.linspace(-2, 2, 6))),
])
def test_a_kernel_with_no_meta_kernel_is_sized_as_it_sizes_its_results(op, args):
    """geqrf and histogram have no meta kernel: sized by their own rules, as the kernel sizes them."""
    want = tuple((tuple(r.shape), r.dtype) for r in op(*args))
    assert meta_results(op, [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], {}) == want


class NoMetaOrCpuSized(torch.nn.Module):
    """geqrf and histogram (no meta kernel); an embedding bag, whose offset2bag and max_indices
    the CPU kernel sizes otherwise than the meta kernel."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 3, mode="sum")

    def forward(self, a, x, idx, off):
        return (*torch.geqrf(a), *torch.histogram(x, bins=5), self.bag(idx, off))


@pytest.mark.parametrize("placement", ["cpu", "emu"])
def test_kernels_meta_cannot_size_as_the_cpu_does_run_and_equal_eager(emu, placement):
    """Before the sizing rules, each of these was refused at load ("cannot tell the size")."""
    torch.manual_seed(0)
    model = NoMetaOrCpuSized().eval()
    args = (torch.randn(5, 3), torch.randn(20), torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2]))
    part = ferry.OpSupportPartitioner("emu:0") if placement == "emu" else None
    module = ferry.Module(ferry.compile(torch.export.export(model, args), part))
    for _ in range(2):
        args = (torch.randn(5, 3), torch.randn(20), torch.randint(0, 10, (6,)), torch.tensor([0, 2]))
        for got, want in zip(module(*args), model(*args)):
            torch.testing.assert_close(got, want.detach())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_hostile_delegate_allocates_nothing_of_its_size_and_a_call_is_counted():
    """The relu delegated to cuda:0: replaced by a 64 MiB `repeat`, the load is refused and the GPU's
    peak never held it; the real program's run-time results on cuda:0 are counted against its cap."""
    program = relu_program(ferry.OpSupportPartitioner("cuda:0"))

    def make(m, relu, add):
        (src,), (out,) = m.instructions[relu].args, m.instructions[relu].outputs
        return [*m.instructions[:relu], KernelCall("aten::repeat.default", (src, ints(add, [1024, 512])), (out,)),
                *m.instructions[relu + 1:]]

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with pytest.raises(ProgramError, match=r"aten::repeat.default.*would be float32\[4096, 4096\]"):
        ferry.Module(payload_with(program, make), max_memory=CAP).load_method()
    assert torch.cuda.max_memory_allocated() - before < 4096 * 4096 * 4
    assert torch.cuda.memory_allocated() == before
    gpu = ferry.Device("cuda", 0)
    need = load_bytes(program, program.method("forward")).get(gpu, 0) + call_bytes(program, program.method("forward"))[gpu]
    with pytest.raises(AllocationError, match="on cuda:0"):
        ferry.Module(program, max_memory={"cuda:0": need - 1}).load_method()
    x = torch.randn(4, 8)
    torch.testing.assert_close(ferry.Module(program, max_memory={"cuda:0": need})(x), torch.relu(x) * 2)


def test_kernels_are_sized_per_call_only_on_a_first_call_at_a_shape(monkeypatch):
    """The sizing is load-time work: a static method's plan is sized when it is bound, and a
    dynamic method's plan for each shape too; only the plan for any shape sizes its kernels as a
    call runs, on the first call at a shape."""
    from ferry.runtime.stages import kernel_steps

    calls = []
    checked = kernel_steps.call_check
    monkeypatch.setattr(kernel_steps, "call_check", lambda *a, **k: calls.append(1) or checked(*a, **k))
    static = ferry.Module(relu_program())
    for _ in range(3):
        static(torch.randn(4, 8))
    assert calls == []
    ep = torch.export.export(ReluTimesTwo(), (torch.randn(4, 8),), dynamic_shapes=({0: torch.export.Dim("b", max=16)},))
    dynamic = ferry.Module(ferry.compile(ep))
    counts = []
    for rows in (4, 4, 4, 7, 7):
        before = len(calls)
        x = torch.randn(rows, 8)
        torch.testing.assert_close(dynamic(x), ReluTimesTwo()(x))
        counts.append(len(calls) - before)
    assert counts[0] > 0 and counts[1] == counts[2] == counts[4] == 0  # (a new shape: sized at most once)
