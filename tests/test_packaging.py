"""A non-editable install ships the .cu files and the loader finds them there."""
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_ships_kernels_and_loader_finds_them(tmp_path):
    src = tmp_path / "src"  # build from a copy: in-tree builds litter the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    str(src), "-w", str(tmp_path / "dist")], check=True)
    (whl,) = (tmp_path / "dist").glob("cupykern-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    kernels = sorted(p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    assert kernels and all(f"cupykern/kernels_cu/{k}" in names for k in kernels)

    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)  # a pure-Python wheel: unpacking is installing
    code = ("import cupykern, cupykern._loader as l; print(l.kernel_dir()); "
            "print(all('#include \"' not in l.source(f) for f in l.registry()))")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [str(site / "cupykern" / "kernels_cu"), "True"]
