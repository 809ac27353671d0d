"""The documented models (README: The four models), KernelBench style.

Each submodule names the op's reference ``Model`` (plain PyTorch, defined once in
``cupykern.torch.<op>``), ``ModelNew`` (our module), ``get_init_inputs()`` and ``get_inputs()`` (CPU tensors at the main
benchmark shape), and ``CASES``: the shapes the main job verifies and times.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

# Submodules in the order the main job runs them, and the class each one documents.
NAMES = ("l1norm", "l2norm", "matmul_sum_max_mean_logsumexp", "gemm_scale_batchnorm")
CLASSES = ("L1Norm", "L2Norm", "MatmulSumMaxMeanLogSumExp", "GemmScaleBatchNorm")


def resolve(names: str) -> list[str]:
    """Submodule names for a comma-separated list of model names, in either spelling
    (``l1norm`` or ``L1Norm``, any case); ValueError listing the valid ones otherwise."""
    known = {n.lower(): n for n in NAMES} | {c.lower(): n for c, n in zip(CLASSES, NAMES)}
    picked = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name.lower() not in known:
            raise ValueError(f"unknown model {name!r}; choose from "
                             + ", ".join(f"{c} ({n})" for c, n in zip(CLASSES, NAMES)))
        picked.append(known[name.lower()])
    if not picked:
        raise ValueError("no model named; choose from " + ", ".join(CLASSES))
    return picked


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape of a model."""

    label: str                              # e.g. "32768x65535 float32"
    init_inputs: tuple                      # ModelNew(*init_inputs)
    make_inputs: Callable[[str], list]      # device -> list of input tensors
    quick: bool = False                     # part of `python -m cupykern --quick`
    nbytes: int = 0                         # fewest DRAM bytes moved (copy-bandwidth model)
    flops: int = 0                          # floating-point operations (tensor-core model)
    atol: float = 1e-4                      # allclose atol = rtol against the reference


def load(name: str):
    """The model submodule ``name`` (see NAMES)."""
    return importlib.import_module(f"{__name__}.{name}")


def available():
    """The model submodules that exist in this build, in NAMES order."""
    import importlib.util

    return [load(n) for n in NAMES if importlib.util.find_spec(f"{__name__}.{n}")]
