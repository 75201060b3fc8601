"""What a string argument of an operator may be, when a program hands it to a code generator.

Inductor turns a graph into C++ or Triton source, and some arguments travel into that source
as text: an assert's message is pasted into the kernel unescaped, so a message read from a
file could be code run on the loading machine. Strings in ATen schemas are otherwise names
from a short list (`rounding_mode="floor"`, `approximate="tanh"`) or an einsum equation. So
every string that reaches code generation is one of the names its argument allows, an
equation in einsum's grammar, or (an assert's message) replaced by ferry's own words; any
other is refused. Nothing else a program carries is text: numbers, dtypes, devices, layouts
and kernel names are checked against their own grammars when a file is read.
"""

from __future__ import annotations

import re

__all__ = ["ASSERT_MESSAGE", "safe_text"]

# what an assert in a delegate says instead of the file's own message
ASSERT_MESSAGE = "a check in the program failed (its message was not taken from the file)"

# argument name -> the values it may take (ATen's schemas name each such argument so)
CHOICES: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    "approximate": ("none", "tanh"),
    "rounding_mode": ("trunc", "floor"),
    "reduce": ("sum", "prod", "mean", "amax", "amin"),
    "indexing": ("ij", "xy"),
    "interpolation": ("linear", "lower", "higher", "midpoint", "nearest"),
    "side": ("left", "right"),
    "norm": ("backward", "ortho", "forward"),
    "padding": ("same", "valid"),
    "mode": ("reduced", "complete", "r"),  # linalg_qr
    "UPLO": ("L", "U"),
    "driver": ("gesvd", "gesvdj", "gesvda", "gels", "gelsy", "gelsd", "gelss"),
    "ord": ("fro", "nuc"),
    "p": ("fro", "nuc"),
    "pad_mode": ("constant", "reflect", "replicate", "circular"),
    "padding_side": ("left", "right"),
    "mapping_type": ("SYMMETRIC", "SYMMETRIC_NO_CLIPPING_ERR", "ASYMMETRIC"),  # torchao's quantization ops
}.items()}

# einsum's grammar: subscripts, commas, an ellipsis, an arrow, spaces
_EQUATION = re.compile(r"[A-Za-z ,.>\-]{0,256}\Z")
_MESSAGES = frozenset({"assert_msg"})


def safe_text(op_name: str, argument: str, value: str) -> str:
    """`value` as it may reach generated source for `argument` of `op_name`: itself when it is
    one of the argument's names (or a well-formed einsum equation), ferry's own words for an
    assert's message; ValueError for anything else."""
    if argument in _MESSAGES:
        return ASSERT_MESSAGE
    if argument in CHOICES:
        if value in CHOICES[argument]:
            return value
        raise ValueError(f"{op_name}: {argument}={value[:40]!r} is not one of {sorted(CHOICES[argument])}")
    if argument == "equation" and _EQUATION.match(value):
        return value
    raise ValueError(f"{op_name}: its string argument {argument!r} ({value[:40]!r}) may not reach compiled code")
