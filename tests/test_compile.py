"""Every registered kernel instantiation compiles with NVRTC for sm_75 to sm_120 (sm_90 as
sm_90a), without ptxas serialising any wgmma; no GPU needed, but CuPy and NVRTC (the
cuda12/cuda13 extra): without them the compiling tests skip, with the reason."""
import pathlib

import pytest

from cupykern import _loader


def test_every_kernel_file_is_registered():
    files = {p.name for p in _loader.kernel_dir().glob("*.cu")}
    assert files and files == set(_loader.registry())


def test_headers_are_inlined_into_the_source():
    for name in _loader.registry():
        text = _loader.source(name)
        assert '#include "' not in text
        assert "acc_of" in text  # common.cuh made it in


@pytest.mark.long
@pytest.mark.nvrtc
@pytest.mark.parametrize("cc", _loader.CHECKED_CCS)
def test_every_kernel_compiles(cc):
    assert _loader.compile_check((cc,)) == []


def test_arch_options():
    assert "-arch=sm_90a" in _loader.arch_options(90)
    assert not any(o.startswith("-arch") for o in _loader.arch_options(80))
    assert pathlib.Path(_loader.kernel_dir()).name == "kernels_cu"


@pytest.mark.nvrtc
def test_hopper_only_kernels_fail_to_compile_for_older_archs():
    """sm_90-only instantiations (wgmma, clusters) are compile errors on sm_80, never
    empty kernels that would launch and do nothing."""
    hopper_only = [(f, e) for f, exprs in _loader.registry().items()
                   for e, (lo, _) in exprs.items() if lo >= 90]
    # (gemm.cu's: split K's second pass over float slabs of 16-bit products, which only
    # Hopper's wgmma makes; it compiles anywhere)
    assert {f for f, _ in hopper_only} == {"gemm.cu", "gemm_wgmma.cu", "normalize.cu"}
    for f, e in (next(p for p in hopper_only if p[0] == "gemm_wgmma.cu"),
                 next(p for p in hopper_only if p[0] == "normalize.cu")):
        with pytest.raises(Exception, match="needs sm_90"):
            _loader.compile_nvrtc(f, [e], 80)


@pytest.mark.nvrtc
def test_a_wrong_launch_constant_does_not_compile():
    """Shared-memory bytes named in Python are static_asserted by the kernel."""
    import re

    from cupykern import gemm_kernels

    expr = gemm_kernels._mma_expr("float32", 0, True)
    wrong = re.sub(r"(\d+)>$", lambda m: f"{int(m.group(1)) + 16}>", expr)
    _loader.compile_nvrtc("gemm_mma.cu", [expr], 80)
    with pytest.raises(Exception, match="gemm_mma: SMEM must be STAGES"):
        _loader.compile_nvrtc("gemm_mma.cu", [wrong], 80)


# Two wgmma on one accumulator with an ordinary write to it between them: ptxas
# serialises them (reported as C7511 by CUDA 12/13's ptxas).
_SERIALISED = """
extern "C" __global__ void serialised_wgmma(float* out, const unsigned* f, unsigned long long db) {
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  const unsigned a[4] = {f[0], f[1], f[2], f[3]};
  wg_arrive();
  wgmma_tf32(d, a, db, 1);
  wg_commit();
  d[0] += 1.f;
  wg_arrive();
  wgmma_tf32(d, a, db, 1);
  wg_commit();
  wg_wait<0>();
  for (int i = 0; i < 64; ++i) out[i * 128 + threadIdx.x] = d[i];
}
"""


@pytest.mark.nvrtc
def test_serialised_wgmma_fails_the_compile_check(monkeypatch):
    source = _loader.source("gemm_wgmma.cu")
    monkeypatch.setattr(_loader, "source", lambda name: source + _SERIALISED)
    with pytest.raises(RuntimeError, match="Potential Performance Loss"):
        _loader.compile_nvrtc("gemm_wgmma.cu", ["serialised_wgmma"], 90)
