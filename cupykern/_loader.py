"""The one kernel loader: every op gets its compiled kernels from here.

It reads ``kernels_cu/<file>.cu``, inlines the project's own ``#include "x.cuh"``
headers (so CuPy's disk-cache key covers every byte that is compiled),
instantiates one template per ``name_expressions`` entry, compiles with NVRTC
through ``cupy.RawModule`` for the current device (``sm_90a`` on Hopper, so
wgmma/TMA/cluster code is allowed), and caches the launchable function per
(file, instantiation, device, dynamic shared memory).

Ops also *register* every instantiation they may launch, and on which archs, so
that :func:`compile_check` can compile all of them without a GPU (CI does this for
sm_75 to sm_120 with the flags CuPy adds at run time).
"""
from __future__ import annotations

import functools
import pathlib
import re

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)
_BASE_OPTIONS = ("-std=c++17",)
# What cupy.RawModule appends to the user's options for NVRTC (cupy 14,
# cupy/cuda/compiler.py); the compile check adds the same so CI compiles what runs.
_CUPY_IMPLICIT = ("-ftz=true", "--device-as-default-execution-space")

# file -> {name expression: (lowest, highest) compute capability it is built for}
_REGISTRY: dict[str, dict[str, tuple[int, int]]] = {}
# Archs the GPU-free compile check covers: Turing to Blackwell (90 is built as sm_90a).
CHECKED_CCS = (75, 80, 86, 89, 90, 100, 120)
_functions: dict = {}


_CUPY = None  # the module once imported (an import statement costs a launch ~0.3 us)


def cupy():
    """The CuPy module; an ImportError naming the extras when it is not installed."""
    global _CUPY
    if _CUPY is None:
        try:
            import cupy as cp
        except ImportError as e:
            raise ImportError("cupykern needs CuPy for GPU arrays and tensors: pip install "
                              "'cupykern[cuda12]' (CUDA 12 driver) or 'cupykern[cuda13]' (CUDA "
                              "13 driver); see the README's install recipes") from e
        _CUPY = cp
    return _CUPY


@functools.lru_cache(maxsize=None)
def kernel_dir() -> pathlib.Path:
    """Where the .cu files are: inside the installed package, else the checkout."""
    here = pathlib.Path(__file__).resolve().parent
    for d in (here / "kernels_cu", here.parent / "kernels_cu"):
        if any(d.glob("*.cu")):
            return d
    raise FileNotFoundError(f"cupykern: no kernels_cu/*.cu next to {here}")


@functools.lru_cache(maxsize=None)
def source(filename: str) -> str:
    """The file's text with every project header inlined once (like #pragma once)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        text = (kernel_dir() / name).read_text()

        def repl(m: re.Match) -> str:
            inc = m.group(1)
            if inc in seen:
                return f"// {inc}: already inlined"
            seen.add(inc)
            return f"// ---- begin {inc}\n{expand(inc)}\n// ---- end {inc}"

        return _INCLUDE.sub(repl, text)

    return expand(filename)


def arch_options(cc: int) -> tuple[str, ...]:
    """Our NVRTC options for compute capability ``cc`` (e.g. 90 -> sm_90a)."""
    if cc == 90:
        return _BASE_OPTIONS + ("-arch=sm_90a",)
    return _BASE_OPTIONS


def register(filename: str, exprs, min_cc: int = 0, max_cc: int = 1000) -> None:
    """Declare instantiations an op may launch on compute capabilities min_cc..max_cc
    (for the GPU-free compile check)."""
    reg = _REGISTRY.setdefault(filename, {})
    for e in exprs:
        lo, hi = reg.get(e, (0, 1000))
        reg[e] = (max(lo, min_cc), min(hi, max_cc))


def registry() -> dict[str, dict[str, tuple[int, int]]]:
    """{file: {name expression: (lowest, highest) compute capability}} of the ops imported
    so far (importing the ``cupykern`` package imports, and so registers, every op)."""
    return _REGISTRY


@functools.lru_cache(maxsize=None)
def device_cc(device: int) -> int:
    return int(cupy().cuda.Device(device).compute_capability)


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    return int(cupy().cuda.Device(device).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def max_shared_per_block(device: int) -> int:
    """The most shared memory one CTA may have (bytes, opted in): 227 KB on Hopper."""
    return int(cupy().cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"])


def function(filename: str, expr: str, device: int, dynamic_smem: int = 0):
    """The launchable ``cupy.cuda.function.Function`` for one instantiation.

    Call it as ``fn(grid, block, args, shared_mem=..., stream=...)``; ``stream``
    is any object with a ``.ptr``.
    """
    key = (filename, expr, device, dynamic_smem)  # everything that changes the function
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = _build(filename, expr, device, dynamic_smem)
    return fn


def _build(filename, expr, device, dynamic_smem):
    cp = cupy()
    with cp.cuda.Device(device):
        mod = cp.RawModule(code=source(filename), options=arch_options(device_cc(device)),
                             name_expressions=(expr,))
        rk = mod.get_function(expr)
        if dynamic_smem > 48 * 1024:
            rk.max_dynamic_shared_size_bytes = dynamic_smem
        return rk.kernel


# What ptxas says when it serialises a kernel's wgmma (C7513-C7515...): a silent slowdown
# of the tensor-core kernels, so the compile check treats it as an error.
_PTXAS_SERIALISED = "Potential Performance Loss"


def compile_nvrtc(filename: str, names, cc: int) -> None:
    """Compile instantiations ``names`` of ``filename`` for compute capability ``cc``
    with NVRTC and CuPy's flags (no GPU needed); raises on a compile error, and a
    RuntimeError where ptxas reports a performance loss (serialised wgmma)."""
    import io

    from cupy.cuda.compiler import _NVRTCProgram

    opts = arch_options(cc) + _CUPY_IMPLICIT + (f"-arch=sm_{cc}",)
    log = io.StringIO()
    _NVRTCProgram(source(filename), filename, name_expressions=list(names),
                  method="cubin").compile(opts, log)
    lost = [line for line in log.getvalue().splitlines() if _PTXAS_SERIALISED in line]
    if lost:
        raise RuntimeError("ptxas: " + "; ".join(lost))


def compile_check(ccs=CHECKED_CCS) -> list[str]:
    """Compile every registered instantiation with NVRTC for each arch; no GPU needed.

    Returns a list of failure messages (empty when everything compiles).
    """
    failures = []
    for filename, exprs in sorted(registry().items()):
        for cc in ccs:
            names = sorted(e for e, (lo, hi) in exprs.items() if lo <= cc <= hi)
            if not names:
                continue
            try:
                compile_nvrtc(filename, names, cc)
            except Exception as e:  # CompileException carries the NVRTC log
                failures.append(f"{filename} (sm_{cc}{'a' if cc == 90 else ''}): {e}")
    return failures
