"""What a user sees on a fresh install: ferry compiles without numpy, and a compile prints no
warning that comes from ferry's own calls into torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import torch

import ferry
import ferry.examples
from ferry.aot.values import eager_strides, tensor_bytes

SRC = Path(__file__).resolve().parents[1] / "src"


def test_compile_save_load_and_run_without_numpy(tmp_path):
    """numpy made unimportable: compiling a model with weights, saving, loading and running work."""
    script = textwrap.dedent(f"""
        import sys, warnings
        sys.modules["numpy"] = None            # `import numpy` now raises ImportError
        warnings.simplefilter("ignore")         # torch's own 'Failed to initialize NumPy'
        import torch, ferry, ferry.examples
        model, example = ferry.examples.transformer_block()
        program = ferry.compile(torch.export.export(model, example))
        program.save({str(tmp_path / "b.ferry")!r})
        x = torch.randn_like(example[0])
        got = ferry.Module({str(tmp_path / "b.ferry")!r})(x)
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
        print("ran without numpy")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran without numpy" in proc.stdout


def test_tensor_bytes_matches_the_elements():
    """The elements as they lie in memory: row-major, or in the memory order of a dense layout
    (a transposed weight), which the program records as the constant's strides."""
    for t in (torch.randn(3, 5), torch.randn(4, 6).t(), torch.arange(7, dtype=torch.int64)[::2],
              torch.randn(5).to(torch.bfloat16), torch.tensor(3.5), torch.zeros(0, 3)):
        raw = tensor_bytes(t)
        assert len(raw) == t.numel() * t.element_size()
        if t.numel():
            strides = eager_strides(t) or torch.empty(t.shape).stride()
            back = torch.frombuffer(bytearray(raw), dtype=t.dtype).as_strided(t.shape, strides)
            assert torch.equal(back, t)


def test_compile_emits_no_future_warning():
    """torch >= 2.13 warns about LeafSpec when a program is deep-copied; ferry's compile must not
    surface that (or any FutureWarning) to the user."""
    model, example = ferry.examples.transformer_block()
    ep = torch.export.export(model, example)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", exclude=["aten.softmax"]))
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert future == []
