"""What a LayerNorm or a chunked gate/up costs a one-row product: the load's timed decision for each.

`python bench/norm_regions.py` (one GPU, about a minute) compiles three small decode-step modules
with ferry's inductor backend and CUDA graphs, at OPT-1.3B's and Phi-3-mini's widths: nn.LayerNorm
before the merged q/k/v product and before fc1, and Phi-3's gate/up product split by `chunk` with
SiLU(gate) * up after it. The load times each product two ways (choices/gemv.py): cuBLAS's product
with the norm's and the activation's kernels of their own, against one Inductor reduction that
computes them inside. The table gives both times, the pick, and the program's largest error
against eager (relative to eager's largest output).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.choices import gemv  # noqa: E402
from ferry.choices.decisions import DECISIONS  # noqa: E402


class LayerNormed(torch.nn.Module):
    """The residual, nn.LayerNorm and a biased product (OPT's q/k/v merged, or its fc1)."""

    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.ln, self.proj = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, out)

    def forward(self, h, r):
        h = h + r
        return self.proj(self.ln(h)), h


class ChunkedMLP(torch.nn.Module):
    """Phi-3's MLP after its RMSNorm: gate and up one product, split by `chunk`."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.gate_up = torch.nn.Linear(hidden, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        f = x.float()
        h = self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up) + x


CASES = [("OPT-1.3B q/k/v", lambda: LayerNormed(2048, 6144), 2048, 2),
         ("OPT-1.3B fc1", lambda: LayerNormed(2048, 8192), 2048, 2),
         ("Phi-3-mini MLP", lambda: ChunkedMLP(3072, 8192), 3072, 1)]


def run_case(name: str, make, hidden: int, inputs: int) -> list[dict]:
    torch.manual_seed(0)
    model = make().to("cuda", torch.bfloat16).eval()
    args = tuple(torch.randn(1, 1, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(inputs))
    io = ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
    program = ferry.compile(torch.export.export(model, args), ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"),
                            ferry.CompileConfig(propagate_device=io))
    module = ferry.Module(program, cuda_graphs=True)
    got, want = module(*args), model(*args)
    got, want = (got[0], want[0]) if isinstance(want, tuple) else (got, want)
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    made = [d for d in DECISIONS.values(timed=True) if d.family == gemv.FAMILY]
    DECISIONS.forget()
    return [{"case": name, "product": d.shape, "times_us": list(d.times_us), "pick": d.pick, "error": error}
            for d in made]


def main() -> None:
    if not torch.cuda.is_available():
        print("norm_regions: skipped: needs a CUDA device")
        return
    rows = [row for case in CASES for row in run_case(*case)]
    print(table("One-row products with what their reduction takes in (µs, cuBLAS's form / the reduction)",
                ["case", "product", "cuBLAS + own kernels", "reduction", "pick", "error"],
                [[r["case"], r["product"], f"{r['times_us'][0]:.1f}", f"{r['times_us'][1]:.1f}", r["pick"],
                  f"{r['error']:.1e}"] for r in rows]))
    print(f"wrote {write_json('norm_regions', {'machine': machine(), 'rows': rows})}")


if __name__ == "__main__":
    main()
