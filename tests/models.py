"""Small shared test models, built with fixed seeds, and the helpers several test files share.

Each builder returns (module, example_inputs); `fresh_inputs(example_inputs, seed)` makes new
random inputs of the same shapes and dtypes, so tests never compare only on the export inputs.
The helpers at the end compare with eager (`assert_like_eager`, `run_vs_eager`), round-trip a
program through bytes (`roundtrip`) and build the skip_h2d/skip_d2h config (`skip_config`).
"""

from __future__ import annotations

import torch
from torch import nn

import ferry
import ferry.examples as ferry_examples
from ferry.program.schema import TensorValue
from ferry.runtime import clone_to


def fresh_inputs(example_inputs, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in example_inputs:
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=g, dtype=t.dtype))
        else:
            out.append(torch.randint(-5, 6, t.shape, generator=g, dtype=t.dtype))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# tiny graphs used by the pass tests


class Add(nn.Module):
    def forward(self, x, y):
        return x + y


class AddChain(nn.Module):
    """z = x + y; w = z + y: two adds, the second reads the first."""

    def forward(self, x, y):
        z = x + y
        return z + y


class FanOut(nn.Module):
    """t = a + b; u = t + a; w = t + b; return u + w."""

    def forward(self, a, b):
        t = a + b
        u = t + a
        w = t + b
        return u + w


class SharedOutput(nn.Module):
    """a = x + y is a method output, feeds a second add and a CPU relu."""

    def forward(self, x, y):
        a = x + y
        b = a + y
        c = torch.relu(a)
        return a, b, c


class InputToCpuAndDelegate(nn.Module):
    """x feeds an add (delegate) and a sin (CPU)."""

    def forward(self, x, y):
        return x + y, torch.sin(x)


class MultiOutput(nn.Module):
    """s = x + y; p = s * y: one delegate of add and mul (ops=add, mul) whose two outputs are read outside."""

    def forward(self, x, y):
        s = x + y
        p = s * y
        return torch.relu(s), torch.relu(p), p - s


class RunningSum(nn.Module):
    """A (2, 3) buffer that adds every input: a mutable buffer read and written in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(2, 3))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


class WithParams(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x):
        return torch.relu(self.lin(x)) + self.offset


def small(shape=(2, 3), n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g) for _ in range(n))


# ---------------------------------------------------------------------------------------------
# real-ish models


class SmallCNN(nn.Module):
    """conv-bn-relu-pool, twice, then a linear head."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(8 * 2 * 2, classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        return self.head(torch.flatten(x, 1))


def small_cnn(batch: int = 2):
    torch.manual_seed(0)
    model = SmallCNN()
    with torch.no_grad():  # non-trivial batch-norm statistics
        for bn in (model.bn1, model.bn2):
            bn.running_mean.copy_(torch.randn(bn.num_features) * 0.1)
            bn.running_var.copy_(torch.rand(bn.num_features) + 0.5)
            bn.weight.copy_(torch.rand(bn.num_features) + 0.5)
            bn.bias.copy_(torch.randn(bn.num_features) * 0.1)
    model.eval()
    return model, (torch.randn(batch, 3, 8, 8),)


class TransformerBlock(ferry_examples.TransformerBlock):
    """The example block (LayerNorm, multi-head attention with softmax, MLP with GELU), small."""

    def __init__(self, dim: int = 16, heads: int = 2, hidden: int = 32):
        super().__init__(dim, heads, hidden)


def transformer_block(batch: int = 2, seq: int = 4):
    torch.manual_seed(0)
    model = TransformerBlock().eval()
    return model, (torch.randn(batch, seq, 16),)


def export(model, example_inputs):
    return torch.export.export(model, tuple(example_inputs))


class TwoLinears(nn.Module):
    """Two submodules, `a` and `b`, with CPU-side glue between them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) + x) + x


# ---------------------------------------------------------------------------------------------
# test partitioners and helpers


class PerAdd:
    """Each aten.add its own delegate; the i-th add goes to devices[min(i, len - 1)]."""

    def __init__(self, *devices, backend_id="torch"):
        self.devices = devices or ("cuda:0",)
        self.backend_id = backend_id

    def partition(self, ep):
        from ferry import Partition, target_device

        adds = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.add.Tensor]
        return [
            Partition([n.name], target_device(self.devices[min(i, len(self.devices) - 1)]), self.backend_id)
            for i, n in enumerate(adds)
        ]


class ByModulePath:
    """A device per module path: every call_function node whose innermost module is `path` goes
    to devices[path], one delegate per path."""

    def __init__(self, devices: dict):
        self.devices = devices

    def partition(self, ep):
        from ferry import Partition, target_device

        groups = {}
        for n in ep.graph.nodes:
            stack = n.meta.get("nn_module_stack")
            if n.op != "call_function" or not stack:
                continue
            path = list(stack.values())[-1][0]
            if path in self.devices:
                groups.setdefault(path, []).append(n.name)
        return [Partition(names, target_device(self.devices[p])) for p, names in groups.items()]


class Fixed:
    """Returns the partitions it was given (for error tests)."""

    def __init__(self, *partitions):
        self.partitions = list(partitions)

    def partition(self, ep):
        return self.partitions


def copy_nodes(gm, direction=None):
    from ferry import ops

    return [n for n in gm.graph.nodes if ops.is_copy_node(n) and direction in (None, ops.COPY_DIRECTION[n.target])]


def count_copies(gm):
    from ferry import ops

    counts = {"h2d": 0, "d2h": 0, "d2d": 0}
    for n in gm.graph.nodes:
        if ops.is_copy_node(n):
            counts[ops.COPY_DIRECTION[n.target]] += 1
    return counts


def delegate_nodes(gm):
    from ferry.aot.lower import is_delegate_node

    return [n for n in gm.graph.nodes if is_delegate_node(n)]


@torch.library.custom_op("ferry_test::twice_plus", mutates_args=())
def twice_plus(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An op with no out variant: it allocates its result at run time."""
    return x * 2 + y


@twice_plus.register_fake
def _(x, y):
    return torch.empty_like(x)


class PermutedRelu(nn.Module):
    """relu keeps a permuted layout, and the view after permuting back relies on it."""

    def forward(self, x):
        return torch.relu(x.permute(1, 0, 2)).permute(1, 0, 2).reshape(-1).view(x.shape[0], -1)


class Tagger(nn.Module):
    """Embedding -> LSTM -> ReLU -> bidirectional GRU -> Linear: a sequence tagger."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.gru = nn.GRU(16, 8, batch_first=True, bidirectional=True)
        self.out = nn.Linear(16, 5)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        h, _ = self.gru(torch.relu(h))
        return self.out(h)


class Attention(nn.Module):
    """Scaled dot-product attention with layer norm, linear and silu around it."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.norm = heads, nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(torch.nn.functional.silu(y.transpose(1, 2).reshape(b, t, d)))


def gpt2_lm(layers: int = 2):
    """A transformers GPT-2 with its default attention, random weights; logits out."""
    import transformers

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                          bos_token_id=0, eos_token_id=0)
            torch.manual_seed(0)
            self.m = transformers.GPT2LMHeadModel(cfg).eval()

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    return Logits().eval(), (torch.randint(0, 256, (1, 16)),)


class Owners(nn.Module):
    """One output of each storage kind: planned, view, constant, run time."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x, y):
        s = x + y
        return s, s.t(), self.w, twice_plus(x, y)


# ---------------------------------------------------------------------------------------------
# comparing with eager, round trips, configs


def assert_like_eager(got, want, **tolerance):
    """A method's outputs (a list, a tuple or one tensor) equal eager's, output by output."""
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tolerance)


def roundtrip(program):
    """`program` through `to_bytes -> load_program`: an equal program (devices of values and
    buffers included) that saves to the same bytes; returns the loaded copy."""
    data = program.to_bytes()
    back = ferry.load_program(data)
    assert back.methods == program.methods
    assert back.delegates == program.delegates
    assert [bytes(s) for s in back.segments] == [bytes(s) for s in program.segments]
    for name, m in program.methods.items():
        b = back.methods[name]
        assert [v.device for v in b.values if isinstance(v, TensorValue)] == [
            v.device for v in m.values if isinstance(v, TensorValue)]
        assert [buf.device for buf in b.buffers] == [buf.device for buf in m.buffers]
    assert back.to_bytes() == data, "saving a loaded program gives the same bytes"
    return back


def run_vs_eager(program, model, example_inputs, seeds=(1, 2), atol=1e-5, rtol=1e-4):
    """Run `program` on fresh inputs (moved to the device of each input) and compare with eager."""
    module = ferry.Module(program)
    meta = module.method_meta("forward")
    for seed in seeds:
        inputs = fresh_inputs(example_inputs, seed)
        args = [t if meta.input_meta(i).device.is_cpu else clone_to(t, meta.input_meta(i).device)
                for i, t in enumerate(inputs)]
        assert_like_eager(module.run_method("forward", args), model(*inputs), atol=atol, rtol=rtol)
    return module


def skip_config(h2d=False, d2h=False, **kw):
    """A CompileConfig whose method inputs (h2d) or outputs (d2h) stay on their device."""
    return ferry.CompileConfig(
        propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=h2d, skip_d2h_for_method_outputs=d2h),
        **kw,
    )


def launched_streams(api, monkeypatch) -> list[str]:
    """The name of the stream each piece of device work is queued on, from now on (the simulated
    device's streams API `api`; clear the list between calls)."""
    names: list[str] = []
    enqueue = type(api).enqueue

    def recording(self, stream, fn, touches_host=False):
        names.append(stream.name)
        return enqueue(self, stream, fn, touches_host)

    monkeypatch.setattr(type(api), "enqueue", recording)
    return names


def loaded_method(module, name: str = "forward"):
    """The method `module` loaded in its first set of memory: its graphs and its plans per shape."""
    # internal: ferry.Module has no public view of the graphs it captured or the shape plans it keeps
    return module._methods[name]


def loaded_bytes(emu, program) -> int:
    """The bytes a Module of `program` holds on the emulated device once `forward` is loaded
    (the Module is closed again)."""
    module = ferry.Module(program)
    module.load_method()
    used = emu.live_bytes
    module.close()
    return used


def one_per_device(pieces, alignment: int = 256) -> list[tuple[int, int]]:
    """(nbytes, index) of the allocations a load makes for its device `pieces` ((nbytes, index)
    each): one per device index, the pieces each rounded up to the emulated device's default
    alignment (runtime/devices/slab.py), sorted."""
    sizes: dict[int, int] = {}
    for nbytes, index in pieces:
        sizes[index] = sizes.get(index, 0) + -(-nbytes // alignment) * alignment
    return sorted((n, index) for index, n in sizes.items() if n)
