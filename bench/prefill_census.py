"""What loading a dynamic prefill costs with the inductor backend, kernel by kernel.

Builds the Llama-1B shape with few layers (random weights, bf16, optionally torchao-quantized as
`bench/llm.py --quant` does), exports decode and a dynamic prefill, compiles with the inductor
backend, and loads the prefill method alone in a fresh Inductor cache; then counts, in that
cache, the Triton kernels generated, the variants compiled (cubins) and the tuned configurations
(and how many coordinate descent found). The 2026-12-04 run that found torchao's process-wide
tuning in ferry's loads (`bench/results/prefill_census_{int4,bf16}.log`) was this count.

    python bench/prefill_census.py --quant int4 --layers 1
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

import torch

import ferry

sys.path.insert(0, os.path.dirname(__file__))
import llm  # noqa: E402  (bench/llm.py: the model and the export recipe)
from common import table, write_json  # noqa: E402


def census(cache: str) -> dict:
    """Kernels, compiled variants and tuned configurations found under an Inductor cache folder."""
    kernels = collections.Counter()
    for path in glob.glob(f"{cache}/**/*.py", recursive=True):
        with open(path) as f:
            kernels.update(re.findall(r"def (triton_\w+)\(", f.read()))
    tuned = [json.load(open(p)) for p in glob.glob(f"{cache}/**/*.best_config", recursive=True)]
    return {"kernels": len(kernels), "variants_compiled": len(glob.glob(f"{cache}/**/*.cubin", recursive=True)),
            "tuned_configs": len(tuned), "found_by_coordinate_descent": sum(bool(t.get("found_by_coordesc")) for t in tuned)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quant", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128, help="the prefill's longest prompt")
    p.add_argument("--out", default="prefill_census")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("prefill_census: skipped: needs a CUDA GPU")
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="ferry_census_")
    llm.MODELS["llama-1b"][2]["num_hidden_layers"] = args.layers
    env = llm.Env(tiny=False, ferry_device="cuda:0", device=torch.device("cuda"), dtype=torch.bfloat16, repeat=1,
                  prefill_repeat=1, quant=args.quant)
    model = llm.build_model("llama-1b", env)
    eps, _ = llm.export_methods(model, 1, 1024, [args.prompt])
    program = ferry.compile(eps, ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"), llm.KEEP_ON_DEVICE)
    module = ferry.Module(program, cuda_graphs=True, outputs="view")
    t0 = time.perf_counter()
    module.load_method("prefill")
    row = {"quant": args.quant, "layers": args.layers, "prompt": args.prompt,
           "load_s": round(time.perf_counter() - t0, 1), **census(cache)}
    print(table("A dynamic prefill's load, kernel by kernel", list(row), [list(row.values())]))
    print("wrote", write_json(args.out, {"rows": [row]}))


if __name__ == "__main__":
    main()
