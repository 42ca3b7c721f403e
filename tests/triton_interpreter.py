"""Run fla's Triton kernels on a CPU through Triton's interpreter (float32 only): import before fla.

Three gaps between the interpreter (triton 3.6) and what fla 0.6.0's kernels expect, closed by patches:
- the autotuner times its configs on a GPU driver ("0 active drivers"): every config ties, the first runs;
- numpy >= 2.4 refuses int() of a one-element 1-D array, which the interpreter's tensor.__index__ does;
- a compiled kernel's `range`/`tl.range` loop variable is a tensor (fla calls `.to` on it), the interpreter's an int.
bfloat16 is out of reach: the interpreter stores it as uint16 bits and its tl.dot and arithmetic act on those bits.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]

_patch_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor


def _tensor_range(*bounds):
    for i in range(*(int(b) for b in bounds)):
        yield tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def _tl_range(arg1, arg2=None, step=None, **_kwargs):
    start, end = (0, arg1) if arg2 is None else (arg1, arg2)
    return _tensor_range(start, end, 1 if step is None else step)


_grid_call = interpreter.GridExecutor.__call__
_patch_core = interpreter._patch_lang_core


def _patch_lang_core(lang, scope):
    _patch_core(lang, scope)
    scope.set_attr(lang, "range", _tl_range)


def _call_with_tensor_ranges(self, *args, **kwargs):
    """While a kernel runs (no host code of fla does), fla's modules see a `range` of int32 scalar tensors."""
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("fla.") and m is not None]
    for module in modules:
        module.__dict__["range"] = _tensor_range
    interpreter._patch_lang_core = _patch_lang_core
    try:
        return _grid_call(self, *args, **kwargs)
    finally:
        interpreter._patch_lang_core = _patch_core
        for module in modules:
            module.__dict__.pop("range", None)


interpreter.GridExecutor.__call__ = _call_with_tensor_ranges
