"""A convolution of one image runs as one GEMM over its patches where the GPU measures that faster than cuDNN,
in plans captured as CUDA graphs only (ferry/choices/conv.py, asked through ferry/choices/hook.py). On the CPU the timing is faked
(conftest's `timed`) and cuDNN is said to take the convolution; the GEMM form, the choice, its
limits and the bound steps that use it are real, and results are checked against eager."""

import contextlib
import math

import pytest
import torch

import ferry
from ferry.capture import TimingRoom
from ferry.choices import conv as conv_choice
from ferry.choices import hook
from ferry.choices import timing as kernel_timing
from ferry.choices.decisions import DECISIONS, Site
from ferry.ops import fused as fused_kernels

CONV_RELU, CONV_ADD_RELU = fused_kernels.CONV_RELU, fused_kernels.CONV_ADD_RELU
CAPTURED = Site(measure=True, captured=True)  # a method loading whose plan runs as CUDA graphs


def chosen(op, args, site=CAPTURED):
    """What the binder's hook answers for the fused convolution `op(*args)`."""
    return hook.choose(op, list(args), {}, site)


def convolutions():
    """The convolutions of one image this process decided."""
    return [d for d in DECISIONS.values() if d.family == "convolution of one image"]


@pytest.fixture
def cudnn(monkeypatch):
    """cuDNN 'takes' every convolution: the choice is then made as on a GPU."""
    # internal: whether cuDNN would run a convolution has no public switch
    monkeypatch.setattr(fused_kernels, "cudnn_takes", lambda *args: True)


def conv_args(ci=8, co=6, h=5, w=4, batch=1, kernel=1, residual=False, dtype=torch.float32,
              stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    x = torch.randn(batch, ci, h, w, dtype=dtype)
    weight, bias = torch.randn(co, ci, *kernel_size(kernel), dtype=dtype), torch.randn(co, dtype=dtype)
    rest = [list(stride), list(padding), list(dilation), 1]
    if residual:
        out = conv_shape(x, weight, stride, padding, dilation)
        return [x, weight, torch.randn(out, dtype=dtype), bias, *rest]
    return [x, weight, bias, *rest]


def conv_shape(x, weight, stride, padding, dilation):
    """The shape of eager's convolution of x by weight, from torch on meta tensors."""
    return tuple(torch.nn.functional.conv2d(x.to("meta"), weight.to("meta"), None, stride, padding, dilation).shape)


def kernel_size(kernel):
    return (kernel, kernel) if isinstance(kernel, int) else kernel


def eager(args, residual):
    x, weight = args[:2]
    bias, z = (args[3], args[2]) if residual else (args[2], None)
    want = torch.nn.functional.conv2d(x, weight, bias, *args[-4:])
    return torch.relu(want + z if residual else want)


def gemm_form(args, residual):
    """conv_as_gemm on a conv_relu (or, with `residual`, conv_add_relu) op's arguments."""
    x, weight = args[:2]
    bias, z = (args[3], args[2]) if residual else (args[2], None)
    return conv_choice.conv_as_gemm(x, weight, bias, z, *args[-4:-1])


CONVS = {  # (kernel, stride, padding, dilation) over an 11x9 image
    "1x1": (1, (1, 1), (0, 0), (1, 1)), "1x1 stride 2": (1, (2, 2), (0, 0), (1, 1)),
    "3x3 padded": (3, (1, 1), (1, 1), (1, 1)), "3x3 stride 2": (3, (2, 2), (1, 1), (1, 1)),
    "7x7 stride 2": (7, (2, 2), (3, 3), (1, 1)), "3x3 dilated": (3, (1, 1), (2, 2), (2, 2)),
    "3x1 uneven": ((3, 1), (2, 1), (1, 0), (1, 1)), "5x5 no padding": (5, (1, 1), (0, 0), (1, 1)),
}


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("residual", [False, True])
def test_the_gemm_form_equals_eager(conv, dtype, residual):
    kernel, stride, padding, dilation = CONVS[conv]
    args = conv_args(h=11, w=9, kernel=kernel, residual=residual, dtype=dtype, stride=stride, padding=padding,
                     dilation=dilation)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}  # sums of up to 392 terms, in another order
    torch.testing.assert_close(gemm_form(args, residual), eager(args, residual), **tol)
    without_bias = list(args)
    without_bias[3 if residual else 2] = None
    torch.testing.assert_close(gemm_form(without_bias, residual), eager(without_bias, residual), **tol)


@pytest.mark.parametrize("conv", CONVS)
def test_every_convolution_of_one_image_is_timed(conv, timed, cudnn):
    kernel, stride, padding, dilation = CONVS[conv]
    args = conv_args(h=11, w=9, kernel=kernel, stride=stride, padding=padding, dilation=dilation)
    fn = chosen(CONV_RELU, args)
    assert fn is not None and timed.calls == 1
    torch.testing.assert_close(fn(*args), eager(args, False), rtol=1e-5, atol=1e-4)
    (made,) = convolutions()
    kh, kw = kernel_size(kernel)
    out = conv_shape(args[0], args[1], stride, padding, dilation)
    assert made.shape == f"{kh}x{kw}, 6x{8 * kh * kw}x{out[2] * out[3]} float32"  # out x inner x pixels
    assert made.op == "ferry::conv_relu" and made.forms == ("cuDNN", "one GEMM over patches") and made.taken


def test_the_gemm_is_chosen_only_where_measured_faster_by_a_margin(timed, cudnn):
    assert chosen(CONV_RELU, conv_args()) is not None
    assert chosen(CONV_ADD_RELU, conv_args(residual=True)) is not None  # another decision
    timed.times = (100.0, 95.0)
    assert chosen(CONV_RELU, conv_args(h=7)) is None
    timed.times = (6.5, 5.0)
    assert chosen(CONV_RELU, conv_args(h=9)) is None
    made = {(d.shape, d.taken) for d in convolutions()}
    assert made == {("1x1, 6x8x20 float32", True), ("1x1 + residual, 6x8x20 float32", True),
                    ("1x1, 6x8x28 float32", False), ("1x1, 6x8x36 float32", False)}
    assert timed.calls == 4
    for _ in range(2):
        chosen(CONV_RELU, conv_args())
    assert timed.calls == 4


def test_only_a_loading_method_times(timed, cudnn):
    in_a_call = Site(measure=False, captured=True)
    assert chosen(CONV_RELU, conv_args(), in_a_call) is None
    assert timed.calls == 0
    chosen(CONV_RELU, conv_args())
    assert chosen(CONV_RELU, conv_args(), in_a_call) is not None and timed.calls == 1


def test_a_1x1_convolution_needs_no_patches_and_is_never_too_large(timed, cudnn, monkeypatch):
    monkeypatch.setattr(fused_kernels, "MAX_PATCHES", 1)  # internal: the patch limit, lowered to reach it
    args = conv_args()
    fn = chosen(CONV_RELU, args)
    assert fn is not None
    torch.testing.assert_close(fn(*args), eager(args, False))
    strided = conv_args(stride=(2, 2))  # strided: its patches are a tensor, over the limit here
    assert chosen(CONV_RELU, strided) is None


def test_each_stride_padding_and_dilation_is_timed_apart(timed, cudnn):
    for stride, padding, dilation in [((1, 1), (1, 1), (1, 1)), ((2, 2), (1, 1), (1, 1)), ((1, 1), (2, 2), (1, 1)),
                                      ((1, 1), (2, 2), (2, 2)), ((1, 1), (1, 1), (1, 1))]:
        args = conv_args(h=11, w=9, kernel=3, stride=stride, padding=padding, dilation=dilation)
        fn = chosen(CONV_RELU, args)
        torch.testing.assert_close(fn(*args), eager(args, False), rtol=1e-5, atol=1e-4)
    assert timed.calls == 4  # the last is the first again


@pytest.mark.parametrize("case", ["batch 2", "stride 0", "negative padding", "dilation 0", "kernel too large", "empty kernel",
                                  "groups", "bf16", "channels last", "tf32 GEMM only", "deterministic", "not cuDNN's",
                                  "no real tensor", "too many patches", "not captured"])
def test_what_is_never_a_gemm(case, timed, monkeypatch):
    """Only in a plan captured as CUDA graphs (else its launches cost more than cuDNN's one), and
    only what the one GEMM computes exactly: one image, without groups, contiguous, in full
    precision; never less precise than eager's convolution, never in place of a convolution eager
    does not give cuDNN, and never for arguments eager refuses (the GEMM must not answer those)."""
    monkeypatch.setattr(fused_kernels, "cudnn_takes", lambda *args: case != "not cuDNN's")
    args = conv_args(batch=2 if case == "batch 2" else 1, kernel=7 if case == "kernel too large" else 3,
                     dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    if case == "stride 0":
        args[3] = [0, 1]
    if case == "negative padding":
        args[4] = [-1, 0]
    if case == "dilation 0":
        args[5] = [0, 0]
    if case == "empty kernel":
        args[1] = args[1][:, :, :0]  # eager refuses a kernel of size 0
    if case == "too many patches":
        # internal: the patch limit, set one below what 8 channels x 3x3 x 3x2 pixels need
        monkeypatch.setattr(fused_kernels, "MAX_PATCHES", 8 * 9 * 3 * 2 - 1)
    if case == "groups":
        args[1], args[6] = args[1][:, :4].contiguous(), 2
    if case == "channels last":
        args[0] = args[0].to(memory_format=torch.channels_last)
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    if case == "no real tensor":
        args[:3] = [t.to("meta") for t in args[:3]]
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if case == "tf32 GEMM only":
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, False
    try:
        assert chosen(CONV_RELU, args, Site(measure=True, captured=case != "not captured")) is None
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert convolutions() == [] and timed.calls == 0


class Bottleneck(torch.nn.Module):
    """ResNet's bottleneck at one image: 1x1, 3x3 and 1x1 convolutions with batch norms, and a residual."""

    def __init__(self, wide=32, narrow=8):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(wide, narrow, 1, bias=False), torch.nn.BatchNorm2d(narrow)
        self.c2, self.b2 = torch.nn.Conv2d(narrow, narrow, 3, padding=1, bias=False), torch.nn.BatchNorm2d(narrow)
        self.c3, self.b3 = torch.nn.Conv2d(narrow, wide, 1, bias=False), torch.nn.BatchNorm2d(wide)
        for bn in (self.b1, self.b2, self.b3):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
        return torch.relu(self.b3(self.c3(y)) + x)


@pytest.mark.parametrize("graphs", [False, True])
def test_bound_steps_run_the_gemm_only_in_captured_plans(graphs, timed, cudnn, emu_async, count_calls):
    calls = count_calls(conv_choice, "conv_as_gemm")
    model = Bottleneck().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 32, 6, 5),)), ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(program, cuda_graphs=graphs)
    module.load_method()
    assert {(d.shape.split(",")[0], d.taken) for d in convolutions()} == (
        {("1x1", True), ("3x3", True), ("1x1 + residual", True)} if graphs else set())
    calls.clear()
    for _ in range(3):
        x = torch.randn(1, 32, 6, 5)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)
    assert sorted(args[3] is not None for args in calls) == (  # with a residual or not
        [False] * 6 + [True] * 3 if graphs else [])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kernel", ["measured", "gemm forced"])
@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_on_cuda_the_convolutions_are_measured_and_equal_eager(kernel, backend, fresh, full_fp32, monkeypatch):
    """ResNet-50's layer-4 bottleneck (2048 and 512 channels at 7x7), with graphs, either backend."""
    if kernel == "gemm forced":
        monkeypatch.setattr(kernel_timing, "KEEP_IF_ABOVE", math.inf)
        monkeypatch.setattr(kernel_timing, "MIN_SAVING_US", -math.inf)
    model = Bottleneck(2048, 512).eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 2048, 7, 7),)),
                            ferry.OpSupportPartitioner("cuda:0", backend_id=backend))
    module = ferry.Module(program, cuda_graphs=True)
    cuda_model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 2048, 7, 7)
        with torch.no_grad():
            torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-4, atol=1e-4)
    made = convolutions()
    assert len(made) == 3 and all(d.device == "cuda:0" and len(d.times_us) == 2 and min(d.times_us) > 0 for d in made)
    assert {d.op for d in made} == ({"aten.convolution"} if backend == "inductor" else {"ferry::conv_relu",
                                                                                     "ferry::conv_add_relu"})
    assert kernel == "measured" or all(d.taken for d in made)


def test_the_gemm_form_takes_a_layout_other_than_the_planned_one(timed, cudnn):
    """Chosen for a contiguous plan, called with an input laid out otherwise (a kernel on the
    GPU may lay its result out differently from the trace): the same result as eager's."""
    meta = conv_args(residual=True)
    meta[0], meta[2] = meta[0].to("meta"), meta[2].to("meta")
    fn = chosen(CONV_ADD_RELU, meta)
    assert fn is not None
    args = conv_args(residual=True)
    args[0] = args[0].transpose(2, 3).contiguous().transpose(2, 3)
    args[2] = args[2].transpose(2, 3).contiguous().transpose(2, 3)
    torch.testing.assert_close(fn(*args), eager(args, True))


@pytest.mark.parametrize("case", ["captured, GEMM faster", "captured, GEMM slower", "not captured"])
def test_the_inductor_backend_compiles_the_convolutions_timed_faster_as_gemms(case, timed, cudnn, emu, monkeypatch):
    """The inductor backend's form of the choice: in a plan captured as CUDA graphs, each
    convolution one GEMM over its patches runs faster (a fake clock) reaches Inductor as
    `im2col` (a reshape for 1x1) and `mm`, not as cuDNN's convolution; results equal eager's."""
    import warnings

    if case == "captured, GEMM slower":
        timed.times = (100.0, 95.0)
    graphs_seen = []
    real = torch._inductor.compile
    monkeypatch.setattr(torch._inductor, "compile", lambda gm, examples, options=None: (
        graphs_seen.append({n.target for n in gm.graph.nodes}) or real(gm, examples, options=options)))
    model = Bottleneck().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 32, 6, 5),)),
                            ferry.OpSupportPartitioner("emu:0", backend_id="inductor"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the emulated device captures no graph)
        module = ferry.Module(program, cuda_graphs=case != "not captured")
        module.load_method()
    made = convolutions()
    assert sorted((d.op, d.shape.split(",")[0], d.taken) for d in made) == (
        [] if case == "not captured" else
        [("aten.convolution", "1x1", case == "captured, GEMM faster")] * 2
        + [("aten.convolution", "3x3", case == "captured, GEMM faster")])
    [targets] = graphs_seen
    gemms = case == "captured, GEMM faster"
    assert bool(targets & {torch.ops.aten.conv2d.default, torch.ops.aten.convolution.default}) is not gemms
    assert (torch.ops.aten.im2col.default in targets) is gemms
    for _ in range(3):
        x = torch.randn(1, 32, 6, 5)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


def one_convolution(target: str, x, weight, bias, stride, padding, dilation) -> torch.fx.GraphModule:
    """A graph of one ATen convolution node (`conv2d` or `convolution`) of constant weights."""
    root = torch.nn.Module()
    root.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        root.bias = torch.nn.Parameter(bias, requires_grad=False)
    g = torch.fx.Graph()
    xin, w = g.placeholder("x"), g.get_attr("weight")
    b = g.get_attr("bias") if bias is not None else None
    conv = [list(stride), list(padding), list(dilation)]
    node = (g.call_function(torch.ops.aten.conv2d.default, (xin, w, b, *conv)) if target == "conv2d" else
            g.call_function(torch.ops.aten.convolution.default, (xin, w, b, *conv, False, [0, 0], 1)))
    g.output((node,))
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("target", ["conv2d", "convolution"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_convolution_handed_to_inductor_as_a_gemm_equals_eager(conv, target, with_bias, timed, cudnn):
    """`gemm_rewrites` on either ATen form of every kernel, stride, padding and dilation of CONVS,
    with a bias and without: the graph then holds no convolution, and it computes eager's, as
    does the form the load times (`_patches_gemm`)."""
    kernel, stride, padding, dilation = CONVS[conv]
    x = torch.randn(1, 8, 11, 9)
    weight, bias = torch.randn(6, 8, *kernel_size(kernel)), torch.randn(6) if with_bias else None
    gm = one_convolution(target, x, weight, bias, stride, padding, dilation)
    made = conv_choice.gemm_rewrites(gm, {next(iter(gm.graph.nodes)): x.to("meta")}, CAPTURED)
    assert [(d.op, d.taken) for d in made] == [("aten.convolution", True)] and timed.calls == 1
    assert not {n.target for n in gm.graph.nodes} & {torch.ops.aten.conv2d.default, torch.ops.aten.convolution.default}
    want = torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation)
    torch.testing.assert_close(gm(x)[0], want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(conv_choice._patches_gemm(x, weight, bias, stride, padding, dilation), want,
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("conv", ["1x1", "1x1 stride 2", "3x3 dilated", "3x1 uneven"])
def test_inductor_compiles_the_rewritten_convolution_to_eagers_result(conv, timed, cudnn):
    """The rewritten graph through Inductor (its C++ code here): the patches' gather, the GEMM
    and the bias give eager's convolution."""
    kernel, stride, padding, dilation = CONVS[conv]
    x = torch.randn(1, 8, 11, 9)
    weight, bias = torch.randn(6, 8, *kernel_size(kernel)), torch.randn(6)
    gm = one_convolution("convolution", x, weight, bias, stride, padding, dilation)
    assert conv_choice.gemm_rewrites(gm, {next(iter(gm.graph.nodes)): x.to("meta")}, CAPTURED)[0].taken
    compiled = torch._inductor.compile(gm, [x])
    y = torch.randn(1, 8, 11, 9)
    torch.testing.assert_close(compiled(y)[0], torch.nn.functional.conv2d(y, weight, bias, stride, padding, dilation),
                               rtol=1e-5, atol=1e-4)


def test_a_calls_memory_counts_the_patches_a_gemm_form_would_allocate(emu):
    """A convolution of one CUDA image may run as one GEMM over its patches (a load-time choice
    the file does not record), whose patches the call allocates: the memory a call needs
    (program/footprint.py `call_bytes`, the room a captured call gets in the graph pool) counts
    the largest, live with the convolution's own result; a 1x1 convolution has none, nor does a
    batch of two."""
    from ferry.program.footprint import call_bytes

    class Convs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.d = torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 1)

        def forward(self, x):
            return torch.relu(self.d(torch.relu(self.c(x))))

    def need(batch: int, device: str) -> int:
        ep = torch.export.export(Convs().eval(), (torch.randn(batch, 8, 32, 32),))
        program = ferry.compile(ep, ferry.OpSupportPartitioner(device))
        (n,) = call_bytes(program, program.method("forward"), handed_out=False).values()
        return n

    result, patches = 16 * 32 * 32 * 4, 8 * 9 * 32 * 32 * 4  # per image; the 3x3's result is live at the 1x1
    assert need(1, "cuda:0") == result + patches
    assert need(1, "emu:0") == 2 * result  # the GEMM form is a CUDA choice
    assert need(2, "cuda:0") == 2 * 2 * result  # two images: cuDNN's call stays


class RoomLending:
    """A captured plan's streams whose load left `room` bytes free in its graph pool; what is
    allocated while its room's context is open is noted."""

    def __init__(self, room: int):
        self.api = type("Api", (), {"device_type": "cuda"})()
        self.room, self.asked, self.inside = room, [], False

    def capture_stream(self, index):
        return "capture stream"

    def timing_room(self, index, nbytes):
        self.asked.append(nbytes)
        return TimingRoom("the plan's pool", self.allocating) if nbytes <= self.room else None

    @contextlib.contextmanager
    def allocating(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


@pytest.mark.parametrize("room", ["enough", "too little"])
@pytest.mark.parametrize("residual", [False, True])
def test_a_convolution_is_timed_with_its_stand_ins_and_results_in_the_room_the_plan_left(room, residual, timed, cudnn,
                                                                                       monkeypatch):
    """A first-stage image of 2 MiB and its result, each a stand-in and a form's result of 1-10
    MiB, took a 20 MiB segment of their own (MobileNetV3's load reserved 86 MiB against eager's 70)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    made_inside, scratch = [], kernel_timing.scratch
    monkeypatch.setattr(kernel_timing, "scratch", lambda t, device, written=False: made_inside.append(
        (t.device.type, streams.inside)) or scratch(t, device, written))
    args = conv_args(ci=8, co=8, h=256, w=256, residual=residual)  # 2 MiB images: large blocks
    args = [a.to("meta") if i in (0, 2) and (i == 0 or residual) else a for i, a in enumerate(args)]
    needed = 2 * (2 << 20)  # the result and the image's stand-in (a residual of its layout shares it)
    streams = RoomLending(needed if room == "enough" else needed - 1)
    fn = conv_choice.form(CONV_ADD_RELU if residual else CONV_RELU, args, {}, Site(measure=True, captured=True,
                                                                                  streams=streams))
    assert fn is not None and streams.asked == [needed]
    (lent,) = timed.rooms
    assert (lent is not None) is (room == "enough")
    stand_ins = [inside for kind, inside in made_inside if kind == "meta"]
    assert stand_ins == [room == "enough"]  # one, made in the room where it was lent


def test_a_convolution_of_small_values_asks_for_no_room(timed, cudnn, monkeypatch):
    """Its blocks are small ones: in the plan's pool they would make a 2 MiB segment it keeps."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = conv_args(ci=8, co=8, h=64, w=64, residual=True)  # 128 KiB images
    args = [a.to("meta") if i in (0, 2) else a for i, a in enumerate(args)]
    streams = RoomLending(1 << 30)
    site = Site(measure=True, captured=True, streams=streams)
    assert conv_choice.form(CONV_ADD_RELU, args, {}, site) is not None
    assert streams.asked == [] and timed.rooms == [None]


def test_the_room_a_convolution_asks_for_counts_a_stand_in_for_every_value_it_reads(timed, cudnn, monkeypatch):
    """A weight computed per call is a value of the call too: its stand-in is made in the room."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = conv_args(ci=512, co=512, h=4, w=4, kernel=3, padding=(1, 1))  # a 9 MiB weight, small images
    args = [a.to("meta") if i in (0, 1) else a for i, a in enumerate(args)]
    streams = RoomLending(1 << 30)
    conv_choice.form(CONV_RELU, args, {}, Site(measure=True, captured=True, streams=streams))
    assert streams.asked == [512 * 512 * 9 * 4]  # the weight (the images, result and patches are small)
