"""What the kernel choices timed at load decided in this process, as lines for people: which
shapes run faster another way than eager's kernel, and the largest saving of each kind (`ferry
run` prints them). A composed multi-head attention's parts are counted though the whole may
stay eager's (it is timed whole as well).
The decisions themselves: gemm_choice.decisions(), attention_choice.decisions(),
conv_choice.decisions()."""

from __future__ import annotations

from collections.abc import Callable

from ferry.runtime.choices import attention as attention_choice
from ferry.runtime.choices import conv as conv_choice
from ferry.runtime.choices import gemm as gemm_choice


def summary() -> list[str]:
    """One line per kind of choice that timed anything; none where nothing was timed (no GPU)."""
    lines = [
        _line("biased GEMMs", "as mm then the bias", gemm_choice.decisions(), lambda d: d.use_gemm,
              _gemm_shape, lambda d: d.gemm_us),
        _line("attention (captured plans)", "as GEMMs and a softmax", attention_choice.decisions(),
              lambda d: d.use_composed, _attention_shape, lambda d: d.composed_us),
        _line("convolutions of one image (captured plans)", "as one GEMM over its patches", conv_choice.decisions(),
              lambda d: d.use_gemm, _gemm_shape, lambda d: d.gemm_us),
    ]
    return [line for line in lines if line]


def _line(label: str, instead: str, made: list, taken: Callable, shape: Callable, other_us: Callable) -> str:
    if not made:
        return ""
    chosen = [d for d in made if taken(d)]
    line = f"{label}: {len(chosen)} of {len(made)} timed at load are faster {instead}"
    if chosen:
        best = max(chosen, key=lambda d: d.eager_us - other_us(d))
        line += f" (largest saving: {shape(best)} {best.dtype}, {best.eager_us:.1f} -> {other_us(best):.1f} µs)"
    return line


def _gemm_shape(d) -> str:
    return f"{d.rows}x{d.inner}x{d.cols}"


def _attention_shape(d) -> str:
    return f"{d.op} {d.batch}x{d.heads}x{d.queries}x{d.head_dim}"
