"""Every registered kernel instantiation compiles with NVRTC for sm_80 and sm_90a (no GPU needed)."""
import pathlib

from cupykern import _loader


def test_every_kernel_file_is_registered():
    files = {p.name for p in _loader.kernel_dir().glob("*.cu")}
    assert files and files == set(_loader.registry())


def test_headers_are_inlined_into_the_source():
    for name in _loader.registry():
        text = _loader.source(name)
        assert '#include "' not in text
        assert "acc_of" in text  # common.cuh made it in


def test_every_kernel_compiles_for_sm80_and_sm90a():
    assert _loader.compile_check((80, 90)) == []


def test_arch_options():
    assert "-arch=sm_90a" in _loader.arch_options(90)
    assert not any(o.startswith("-arch") for o in _loader.arch_options(80))
    assert pathlib.Path(_loader.kernel_dir()).name == "kernels_cu"
