"""Kernel choices: which kernel or form runs each op, decided once per shape and recorded.

One engine: every choice is a `Decision` (decisions.py) kept in one cache (`DECISIONS`); the
binder asks through one hook (`hook.choose`); each op family has one module holding its forms,
the checks of what each accepts and its compile-time patterns (gemm.py, conv.py, attention.py);
`out_kernels.py` decides at compile time between an op's `.out` overload and its functional
kernel; `timing.py` times two forms on the GPU; `summary.py` puts what was timed into lines.
"""
