"""The Program data model (schema), its file format (codec, format), its checks (validate)."""

from ferry.program.format import FORMAT_VERSION, SEGMENT_ALIGNMENT
from ferry.program.program import Program, load_program, program_to_bytes, save_program
from ferry.program.report import CopyReport, CopyRow, copy_report
from ferry.program.schema import (
    CONST_KINDS,
    DEFAULT_ARG,
    STORAGE_KINDS,
    Buffer,
    ConstValue,
    Delegate,
    DelegateCall,
    InputWrite,
    Instruction,
    KernelCall,
    Method,
    MethodMeta,
    MutableBuffer,
    PlanEntry,
    QuantizedWeight,
    TensorMeta,
    TensorValue,
    Value,
    dtype_from_name,
    dtype_name,
    element_size,
)
from ferry.program.validate import validate_program

__all__ = [
    "CONST_KINDS", "DEFAULT_ARG", "STORAGE_KINDS", "Buffer", "ConstValue", "CopyReport", "CopyRow", "Delegate",
    "DelegateCall", "InputWrite", "Instruction", "KernelCall", "Method", "MethodMeta", "MutableBuffer", "PlanEntry", "Program",
    "QuantizedWeight", "TensorMeta", "TensorValue", "Value", "dtype_from_name", "dtype_name", "element_size", "FORMAT_VERSION",
    "SEGMENT_ALIGNMENT", "copy_report", "load_program", "program_to_bytes", "save_program", "validate_program",
]
