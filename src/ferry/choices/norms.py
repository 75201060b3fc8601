"""The layer-norm family, at load: in a plan captured as CUDA graphs, ATen's layer norm or
ops/layer_norm.py's Triton kernel, which normalises several short rows per program where ATen's
gives each row a block (Swin-T's 3,136 rows of 96 on an H100: 4 µs a norm). Each distinct norm
is timed both ways on the GPU it loads on and the Triton kernel kept where it saves 10%
(choices/timing.py); both launch one kernel. Only captured: uncaptured, the Python launch costs
the host more than the kernel saves. Equal to eager within rounding (ops/layer_norm.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferry.choices import timing
from ferry.choices.decisions import DECISIONS, Decision, Site
from ferry.ops import layer_norm as rows_norm

__all__ = ["FORMS", "ON", "OPS", "decision", "form"]

aten = torch.ops.aten
LAYER_NORM = aten.layer_norm.default
OPS = frozenset({LAYER_NORM})
FORMS = ("ATen", "rows per program (Triton)")
ON = True  # off: ATen's kernel always, untimed (bench/profile_graphs.py --layer-norms off, an A/B)


def form(op, args: list, kwargs: dict, site: Site) -> Callable | None:
    """The load-time hook (choices/hook.py): the Triton form where it was timed faster here."""
    made = decision(args, kwargs, site)
    return rows_norm.layer_norm if made is not None and made.taken else None


def decision(args: list, kwargs: dict, site: Site) -> Decision | None:
    """The timed choice for one layer norm (its arguments real or meta tensors), or None where
    the Triton kernel does not compute it or nothing may be timed: uncaptured, no Triton, not on
    a GPU, a layout or dtype it does not take (ops/layer_norm.fits)."""
    x, shape, weight, bias, eps = _params(args, kwargs)
    if not ON or not site.captured or not rows_norm.available() or not rows_norm.fits(x, shape, weight, bias):
        return None
    device = timing.gpu_of([t for t in (x, weight, bias) if t is not None], site.device)
    if device is None:
        return None
    key = ("layer norm", str(device), site.replays, tuple(x.shape), x.dtype, weight is not None, bias is not None)
    return DECISIONS.get(key, lambda: _decide(device, x, shape, weight, bias, eps, site),
                         timing.may_time(site, device))


def _params(args: list, kwargs: dict):
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    given = dict(zip(names, args))
    given.update({k: v for k, v in kwargs.items() if k in names})
    return (given.get("input"), list(given.get("normalized_shape") or ()), given.get("weight"), given.get("bias"),
            float(given.get("eps", 1e-5)))


def _decide(device, x, shape, weight, bias, eps, site: Site) -> Decision | None:
    with timing.on(device), torch.no_grad():
        try:
            x, w, b = (timing.scratch(t, device) if t is not None else None for t in (x, weight, bias))
            times = timing.time_both(lambda: LAYER_NORM(x, shape, w, b, eps),
                                     lambda: rows_norm.layer_norm(x, shape, w, b, eps), site.replay_stream())
        except Exception:  # noqa: BLE001 - out of memory, or Triton could not build its kernel here: ATen's stays
            return None
    rows = x.numel() // x.shape[-1]
    return timing.decision("layer norm", str(LAYER_NORM.name()), f"{rows}x{x.shape[-1]}", device, x.dtype, FORMS,
                           times, min_saving_us=0)
