"""Where a notebook's stored outputs come from: the GPU, the versions, the commit, and a
fingerprint of what produced them (cupykern's op, torch-layer and model sources, the
kernels, the stored sweeps the benchmarks notebook plots, and the notebook's own code
cells), which a CPU test compares with the tree's (tests/test_notebook.py), so stored
outputs cannot silently go stale."""
from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
import platform
import subprocess

_PACKAGE = pathlib.Path(__file__).resolve().parent
# What the notebooks exercise (the benchmarks' own modules and scripts are left out).
_SOURCES = ("*.py", "torch/*.py", "models/*.py")


def _files() -> list[pathlib.Path]:
    from ._loader import kernel_dir

    files = [p for pattern in _SOURCES for p in _PACKAGE.glob(pattern)]
    files += [p for p in kernel_dir().iterdir() if p.suffix in (".cu", ".cuh")]
    return sorted(files, key=lambda p: (p.parent.name, p.name))


def code_cells(notebook) -> str:
    """The notebook's code cells' sources, as the fingerprint reads them."""
    nb = json.loads(pathlib.Path(notebook).read_text())
    return "\n\0".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                       for c in nb["cells"] if c["cell_type"] == "code")


def fingerprint(notebook) -> str:
    """sha256 (16 hex digits) of the sources the notebook runs, the sweeps' JSON it plots
    (``docs/results/*_sweep.json`` beside its folder) and its code cells."""
    h = hashlib.sha256()
    results = pathlib.Path(notebook).resolve().parent.parent / "docs" / "results"
    for p in _files() + sorted(results.glob("*_sweep.json")):
        h.update(f"{p.parent.name}/{p.name}\0".encode())
        h.update(p.read_bytes())
    h.update(code_cells(notebook).encode())
    return h.hexdigest()[:16]


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=_PACKAGE, text=True, capture_output=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return head + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def report(notebook) -> str:
    """Lines naming what produced the outputs below (printed by each notebook's first cell)."""
    import cupykern

    try:
        import torch
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU only)"
        torch_version = torch.__version__
    except ImportError:
        gpu, torch_version = "unknown (no PyTorch)", "not installed"
    try:
        import cupy
        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = "not installed"
    return "\n".join([
        f"GPU: {gpu}",
        f"python {platform.python_version()}, torch {torch_version}, cupy {cupy_version}, "
        f"cupykern {cupykern.__version__}",
        f"commit: {_commit()}",
        f"fingerprint: {fingerprint(notebook)}",
        f"executed: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"])
