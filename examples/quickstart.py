"""Compile a transformer block with a GPU partition and a CPU fallback, run it, check it.

Runs on CUDA when a GPU is present, otherwise on ferry's emulated device (host memory
standing in for a GPU), and says which.
"""

import tempfile
from pathlib import Path

import torch

import ferry
from ferry.examples import transformer_block
from ferry.runtime import EmulatedAllocator, register_allocator

if torch.cuda.is_available():
    device = "cuda:0"
    print(f"running on {torch.cuda.get_device_name(0)} ({device})")
else:
    register_allocator(EmulatedAllocator())
    device = "emu:0"
    print("no GPU found: running on the emulated device emu:0 (host memory standing in for a GPU)")

model, example = transformer_block()
exported = torch.export.export(model, example)
# everything on the device except softmax, which falls back to the CPU
partitioner = ferry.OpSupportPartitioner(device, exclude=["aten.softmax"])
program = ferry.compile(exported, partitioner)

path = Path(tempfile.mkdtemp()) / "block.ferry"
program.save(path)
module = ferry.Module(path)

from ferry.inspect import program_summary  # noqa: E402

print(program_summary(ferry.load_program(path), instructions=True))

x = torch.randn_like(example[0])
got = module(x)
with torch.no_grad():
    want = model(x)
err = (got.cpu() - want).abs().max().item()
print(f"max |ferry - eager| = {err:.3g}")
assert torch.allclose(got.cpu(), want, atol=1e-4, rtol=1e-4), "ferry's result differs from eager PyTorch"
print("OK: ferry matches eager PyTorch")
