"""`ferry.distributed.Module`: one program over the processes of a torch.distributed job (the
public name; the runtime's part lives in runtime/parallel/ranks.py, docs/distributed.md says how)."""

from ferry.runtime.parallel.ranks import Module

__all__ = ["Module"]
