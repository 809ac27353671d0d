"""Small-shape GEMM + BN run for compute-sanitizer (memcheck / racecheck):
``compute-sanitizer --tool memcheck python tests/sanitize_gemm.py``."""
import torch

import cupykern
from cupykern.torch import GemmScaleBatchNorm

torch.manual_seed(0)
for m, n, k in ((130, 136, 72), (37, 23, 50)):  # edge tiles, aligned and unaligned paths
    x, w, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(n, device="cuda")
    for prec in ("highest", "high", "medium"):
        cupykern.linear(x, w, b, precision=prec)
    cupykern.linear(x.half(), w.half(), b.half())
    cupykern.linear(x.double(), w.double(), b.double())
    mod = GemmScaleBatchNorm(k, n, (n,)).cuda()
    with torch.no_grad():
        mod(x)
        mod.eval()
        mod(x)
torch.cuda.synchronize()
print("sanitize run done")
