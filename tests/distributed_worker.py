"""One rank of a two-process ferry.distributed job, for tests/test_distributed.py.

argv: program path, inputs path (per call, a tuple of input tensors or {"args": tuple, "kwargs":
dict}), result path, and a
JSON object of options. Rank 0 saves the outputs (or the error it got); other ranks serve.
"""

import faulthandler
import json
import os
import sys
import time

import torch

import ferry
import ferry.distributed
from ferry.runtime import EmulatedAllocator, register_allocator


def main() -> int:
    program, inputs, result, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    register_allocator(EmulatedAllocator(asynchronous=options.get("asynchronous", False)))
    rank = int(os.environ["RANK"])
    if "dump_after" in options:  # where every thread is, should the job hang (shown by the test)
        faulthandler.dump_traceback_later(options["dump_after"], exit=False)
    report: dict = {"rank": rank}
    try:
        with ferry.distributed.Module(program, timeout=options.get("timeout", 30), cuda_graphs=options.get("graphs", False),
                                      microbatches=options.get("microbatches")) as module:
            die = options.get("die", {})
            if str(rank) in die:  # this rank exits abruptly at the start of call number die[rank]
                calls = [0]
                attr = "run_method" if rank == 0 else "run_parts"
                run = getattr(module.module, attr)

                def dying(*args):
                    calls[0] += 1
                    if calls[0] == die[str(rank)]:
                        os._exit(9)
                    return run(*args)

                setattr(module.module, attr, dying)
            report["transfers"] = sum(1 for ins in module.module.program.method("forward").instructions
                                      if getattr(ins, "kernel", "").startswith("ferry::"))
            if rank == 0:
                outs, errors, after = [], [], []
                for x in torch.load(inputs):
                    start = time.monotonic()
                    try:
                        args, kwargs = (x["args"], x["kwargs"]) if isinstance(x, dict) else (x, {})
                        outs.append(module(*args, **kwargs))
                        after.append([t.clone() for t in args])  # what the call left in its inputs
                    except ferry.FerryError as e:
                        report.update(error=type(e).__name__, message=str(e), seconds=time.monotonic() - start)
                        print(f"rank 0: {type(e).__name__} after {time.monotonic() - start:.1f} s", flush=True)
                        report["failed_at"] = time.monotonic()
                        errors.append(type(e).__name__)
                        if not options.get("keep_going"):
                            break
                        outs.append(None)
                report.update(outputs=outs, errors=errors, inputs_after=after)
            else:
                module.serve()
    except ferry.FerryError as e:
        report.update(error=type(e).__name__, message=str(e))
    print(f"rank {rank}: closed", flush=True)
    report["closed_after"] = time.monotonic() - report.pop("failed_at", time.monotonic())
    torch.save(report, result)
    if options.get("exit_after_peer_error") and report.get("error") == "PeerError":
        os._exit(3)  # what a job does after a PeerError over NCCL: end, for torchrun to restart it
    return 0


if __name__ == "__main__":
    sys.exit(main())
