"""What the Triton kernel modules share: where they can run, and two fixes to the interpreter.

Triton decides at `@triton.jit` time, i.e. when a kernel module is imported, whether its
kernels are compiled for the GPU or run by the interpreter (`TRITON_INTERPRET=1`, numpy on
the CPU: slow but exact; how CI checks the kernels without a GPU). Importing this module
records that decision for the kernel modules, which import it first, and (interpreter
only) patches two gaps of triton 3.6's interpreter that these kernels hit; both patches
wrap the interpreter's per-launch patching hooks and change nothing in compiled mode.
"""

from __future__ import annotations

import os

import numpy as np
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check_device_runs_triton(device: torch.device) -> None:
    """ValueError unless this process can run the Triton kernels on `device`."""
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "Triton kernels on CPU need the interpreter: set TRITON_INTERPRET=1 before the Triton "
            "kernels are first imported (kernels.triton_attention / kernels.triton_cache)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels run on cuda, or on cpu under TRITON_INTERPRET=1; got {device}")


def _interpret_library_functions_imported_compiled() -> None:
    """Let interpreted kernels call triton.language's own @jit functions (tl.zeros, tl.max, ...).

    Triton wraps those library functions for the interpreter only if `triton.language` was
    first imported with TRITON_INTERPRET=1 already set. A process that imported triton
    earlier (transformers' Llama does, through torch) and set it later (a test module, just
    before importing the kernels) hands interpreted kernels compiled-mode library functions,
    which refuse to run outside a compiled kernel. Each interpreted launch then also swaps
    those for interpreter wrappers, in the interpreter's own patch scope (restored when the
    launch ends, like its other patches).
    A no-op when the library is already interpreted, on a triton without that hook, or twice.
    """
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "pagoda_library_fix", False):
        return
    modules = [tl, tl.core, tl.math, tl.standard]
    compiled = {
        id(member): member
        for module in modules
        for member in vars(module).values()
        if isinstance(member, JITFunction)
    }
    if not compiled:
        return
    wrappers = {key: interpreter.InterpretedFunction(fn.fn) for key, fn in compiled.items()}

    def patch_lang(fn):
        scope = original(fn)
        for module in modules:
            for name, member in list(vars(module).items()):
                if id(member) in wrappers and member is compiled[id(member)]:
                    scope.set_attr(module, name, wrappers[id(member)])
        return scope

    patch_lang.pagoda_library_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang


def _fix_interpreter_index_for_numpy_2_4() -> None:
    """Let interpreted kernels loop over `range(start, end)` with runtime bounds under numpy >= 2.4.

    The interpreter holds a scalar as a 1-element array and converts it for `range` with
    `int(array)`, which numpy 2.4 turned into a TypeError (triton-lang/triton#9171, fixed
    upstream by #9172, not in triton 3.6). This re-registers `__index__` the way the fix
    does, on top of the interpreter's own per-launch patching (its scope restores both
    in reverse order). A no-op on older numpy, on a triton without that hook, or twice.
    """
    if np.lib.NumpyVersion(np.__version__) < "2.4.0":
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "pagoda_index_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.pagoda_index_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRETED:
    _fix_interpreter_index_for_numpy_2_4()
    _interpret_library_functions_imported_compiled()
