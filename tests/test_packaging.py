"""A non-editable install ships the .cu files and the loader finds them there."""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import numpy as np

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
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
               for n in names), sorted(names)

    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = zipfile.ZipFile(whl).read(meta).decode()
    assert "Author: cupykern developers" in meta and "Requires-Python: >=3.11" in meta
    assert sys.version_info >= (3, 11)  # what the suite runs on is what python_requires allows
    tested = {f"Programming Language :: Python :: 3.{v}" for v in (11, 12)}  # CI's, the GPU machine's
    assert tested <= set(re.findall(r"^Classifier: (.*)$", meta, re.M))

    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)  # a pure-Python wheel: unpacking is installing
    code = ("import cupykern, cupykern._loader as l; print(l.kernel_dir()); "
            "print(all('#include \"' not in l.source(f) for f in l.registry()))")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [str(site / "cupykern" / "kernels_cu"), "True"]


def _run_without(module, code):
    """Run ``code`` in a fresh interpreter where ``import module`` fails."""
    pre = f"import sys; sys.modules[{module!r}] = None\n"
    return subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True)


def test_missing_torch_names_what_to_install():
    r = _run_without("torch", "import cupykern, numpy as np\n"
                              "print(cupykern.l1_normalize(np.ones((2, 3), np.float32)).sum())\n"
                              "import cupykern.torch")
    assert r.stdout.strip() == "6.0"  # the array functions need no torch
    assert "ImportError: cupykern.torch needs PyTorch" in r.stderr and "install" in r.stderr


def test_missing_cupy_names_the_extras():
    r = _run_without("cupy", "import cupykern._loader as l\nl.cupy()")
    assert "cupykern[cuda12]" in r.stderr and "cupykern[cuda13]" in r.stderr


def test_main_job_without_torch_says_so():
    r = _run_without("torch", "import sys; from cupykern.__main__ import main; sys.exit(main([]))")
    assert r.returncode == 0, r.stderr
    assert "PyTorch is not installed" in r.stdout and "MISMATCH" not in r.stdout


def test_editable_install_imports_from_beside_the_clone(tmp_path):
    """``pip install -e .``, then a script in the folder that holds the clone: its folder
    ``cupykern/`` (no __init__.py) must not shadow the installed package as an empty
    namespace package (setup.cfg's [editable_wheel] mode = compat puts the clone's root on
    sys.path through a .pth file)."""
    clone = tmp_path / "cupykern"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
        ".benchmarks"))
    venv = tmp_path / "venv"  # with this interpreter's pip, numpy and setuptools (no download)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # numpy from wherever this interpreter has it (another virtual environment, say: the
    # venv's system site is the base interpreter's); a name that sorts after the install's
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (pathlib.Path(site) / "zz_numpy.pth").write_text(str(pathlib.Path(np.__file__).parents[1]) + "\n")
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "-e", str(clone)], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    script = tmp_path / "s.py"
    script.write_text("import numpy as np, cupykern\n"
                      "print(cupykern.__file__)\n"
                      "print(cupykern.l1_normalize(np.ones((2, 3), np.float32)).sum())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (the install alone)
    r = subprocess.run([python, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(clone / "cupykern" / "__init__.py"), "6.0"], r.stdout
    # an edit in the clone is seen without reinstalling (the point of an editable install)
    (clone / "cupykern" / "_probe.py").write_text("VALUE = 42\n")
    r = subprocess.run([python, "-c", "import cupykern._probe as p; print(p.VALUE)"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.stdout.strip() == "42", r.stderr
