"""Whole models, converted in one line: ``python -m cupykern.benchmarks.models`` (GPU only).

Two models in plain PyTorch (nn.Linear, nn.LayerNorm, nn.BatchNorm1d, attention written
by hand with matmul and softmax), trained in float32 with SGD:

* ``transformer``: a BERT-base-shaped encoder (post-LayerNorm layers of fused QKV
  projection, hand-written attention, output projection, GELU FFN; 12 layers, hidden
  768, 12 heads, FFN 3072) on a batch of 8 x 512 tokens (random embeddings in,
  mean-squared error against a random target);
* ``mlp``: Linear -> BatchNorm1d -> ReLU blocks (4 blocks, 4096 wide) and a Linear head
  to 1000 classes, batch 1024, cross-entropy.

Each runs in three forms from the same initial weights and batch: ``cupykern`` (the model
after ``cupykern.torch.convert(model)``: every nn.Linear on cupykern.linear, each
Linear -> BatchNorm1d pair one fused call; the transformer's attention on
``cupykern.torch.attention.scaled_dot_product``), at PyTorch's default float32 precision
"highest"; ``sgemm`` (the model as built, TF32 off: "highest"); ``tf32`` (the model as
built, "high"). Step: zero_grad, forward, loss, backward, SGD step. ``ms``: the median
step time after warm-up, CUDA events around each step on torch's current stream with the
GPU idle before it (host time included), the three forms' steps interleaved. Error: the
first step's loss and gradients against a float64 run of the same model from the same
weights and batch: ``loss err`` = |loss - loss64| / |loss64|, ``grad err`` = max |g - g64|
/ max |g64| over every parameter's gradient flattened into one vector. ``--json PATH``
writes the rows.
"""
from __future__ import annotations

import argparse
import copy
import functools
import math
import sys

from cupykern.benchmark import require_gpu, run_meta, time_each, torch

# form -> (converted?, float32 matmul precision)
FORMS = {"cupykern": (True, "highest"), "sgemm": (False, "highest"), "tf32": (False, "high")}
MODELS = ("transformer", "mlp")


def plain_attention(q, k, v):
    """softmax(q @ k^T / sqrt(E)) @ v, as a hand-written attention block has it."""
    return torch.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1])), dim=-1) @ v


@functools.lru_cache(maxsize=None)
def _classes():
    """The transformer's module classes (made on first use: the module answers --help
    without torch)."""
    from torch import nn

    class EncoderLayer(nn.Module):
        """A BERT layer (post-LayerNorm): x = LN(x + proj(attention(qkv(x)))),
        x = LN(x + FFN(x)). ``attend(q, k, v)``: the attention function, an attribute."""

        def __init__(self, hidden, heads, ffn):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.ln1 = nn.LayerNorm(hidden)
            self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
            self.ln2 = nn.LayerNorm(hidden)
            self.attend = plain_attention

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, C)
            x = self.ln1(x + self.proj(y))
            return self.ln2(x + self.ffn(x))

    class Encoder(nn.Module):
        def __init__(self, layers, hidden, heads, ffn):
            super().__init__()
            self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Encoder


def build_transformer(layers=12, hidden=768, heads=12, ffn=3072):
    """The encoder, in plain PyTorch (parameters from the current RNG and default device)."""
    return _classes()(layers, hidden, heads, ffn)


def build_mlp(width=4096, depth=4, classes=1000):
    """``depth`` blocks of Linear -> BatchNorm1d -> ReLU, then a Linear head."""
    from torch import nn

    blocks = []
    for _ in range(depth):
        blocks += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def convert_model(model):
    """The model on cupykern: ``cupykern.torch.convert(model)``, and hand-written attention
    (a module's ``attend`` attribute) on ``cupykern.torch.attention.scaled_dot_product``."""
    from cupykern.torch import convert
    from cupykern.torch.attention import scaled_dot_product

    model = convert(model)
    for m in model.modules():
        if "attend" in m.__dict__:
            m.attend = scaled_dot_product
    return model


def make_batch(model_name, sizes, device, seed=1):
    """``(x, target)`` for the model: random embeddings and targets (transformer), or
    random inputs and class labels (mlp)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if model_name == "transformer":
        b, t, h = sizes["batch"], sizes["seq"], sizes["hidden"]
        x = torch.randn(b, t, h, generator=g)
        target = torch.randn(b, t, h, generator=g)
    else:
        x = torch.randn(sizes["batch"], sizes["width"], generator=g)
        target = torch.randint(0, sizes["classes"], (sizes["batch"],), generator=g)
    return x.to(device), target.to(device)


def loss_of(model_name, out, target):
    import torch.nn.functional as F

    if model_name == "transformer":
        return F.mse_loss(out, target)
    return F.cross_entropy(out, target)


def build(model_name, sizes):
    if model_name == "transformer":
        return build_transformer(sizes["layers"], sizes["hidden"], sizes["heads"], sizes["ffn"])
    return build_mlp(sizes["width"], sizes["depth"], sizes["classes"])


def first_step(model_name, model, batch):
    """The loss (float) and every parameter's gradient flattened into one float64 vector,
    after one forward and backward from the model's current weights."""
    x, target = batch
    model.zero_grad(set_to_none=True)
    loss = loss_of(model_name, model(x), target)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    return loss.item(), grads


def errors(loss, grads, loss64, grads64) -> tuple[float, float]:
    """(relative loss error, max-abs gradient error relative to max |g64|)."""
    return (abs(loss - loss64) / abs(loss64),
            ((grads - grads64).abs().max() / grads64.abs().max()).item())


def sizes_for(args) -> dict:
    if args.quick:
        return {"layers": args.layers or 2, "hidden": 256, "heads": 4, "ffn": 1024,
                "batch": 4, "seq": 128, "width": 1024, "depth": 2, "classes": 100,
                "mlp_batch": 256}
    return {"layers": args.layers or 12, "hidden": 768, "heads": 12, "ffn": 3072, "batch": 8,
            "seq": 512, "width": args.width, "depth": args.depth, "classes": 1000,
            "mlp_batch": 1024}


def run_model(model_name, sizes, steps, warmup, lr=1e-3, device="cuda", timed=True) -> list[dict]:
    """One row per form: step time, loss and gradient error (see the module docstring).
    ``timed=False`` (any device, e.g. a CPU check of the script): the errors alone."""
    sz = dict(sizes, batch=sizes["mlp_batch"]) if model_name == "mlp" else sizes
    torch.manual_seed(0)
    with torch.device(device):
        base = build(model_name, sz)
    batch = make_batch(model_name, sz, device)
    x64, t64 = batch[0].double(), batch[1].double() if batch[1].is_floating_point() else batch[1]
    loss64, grads64 = first_step(model_name, copy.deepcopy(base).double(), (x64, t64))
    old = torch.get_float32_matmul_precision()
    rows, steps_of = [], []
    try:
        for form, (converted, precision) in FORMS.items():
            model = copy.deepcopy(base)
            if converted:
                model = convert_model(model)
            torch.set_float32_matmul_precision(precision)
            loss, grads = first_step(model_name, model, batch)
            le, ge = errors(loss, grads, loss64, grads64)
            rows.append({"model": model_name, "form": form, "precision": precision,
                         "shape": _shape(model_name, sz), "loss": loss, "loss64": loss64,
                         "loss_err": le, "grad_err": ge, "ms": None, "x_sgemm": None})
            if timed:
                opt = torch.optim.SGD(model.parameters(), lr=lr)
                steps_of.append(_step(model_name, model, opt, batch, precision))
        times = time_each(steps_of, iters=steps, warmup=warmup, flush=False) if timed else []
    finally:
        torch.set_float32_matmul_precision(old)
    if timed:
        sgemm = times[list(FORMS).index("sgemm")]
        for row, ms in zip(rows, times):
            row["ms"] = ms
            row["x_sgemm"] = sgemm / ms
    return rows


def _step(model_name, model, opt, batch, precision):
    x, target = batch

    def step():
        torch.set_float32_matmul_precision(precision)  # (the forms' steps are interleaved)
        opt.zero_grad(set_to_none=True)
        loss_of(model_name, model(x), target).backward()
        opt.step()

    return step


def _shape(model_name, sz) -> str:
    if model_name == "transformer":
        return (f"{sz['layers']}L h{sz['hidden']} {sz['heads']}h ffn{sz['ffn']} "
                f"{sz['batch']}x{sz['seq']}")
    return f"{sz['depth']}x{sz['width']} ->{sz['classes']} b{sz['batch']}"


def _num(v, fmt) -> str:
    return format(v, fmt) if v is not None else " " * int(fmt.split(".")[0])


def print_rows(rows) -> None:
    print(f"{'model':<12} {'shape':<34} {'form':<9} {'precision':<9} {'ms':>9} {'x sgemm':>8} "
          f"{'loss err':>9} {'grad err':>9}")
    for r in rows:
        print(f"{r['model']:<12} {r['shape']:<34} {r['form']:<9} {r['precision']:<9} "
              f"{_num(r['ms'], '9.3f')} {_num(r['x_sgemm'], '8.2f')} {r['loss_err']:9.2e} "
              f"{r['grad_err']:9.2e}",
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cupykern.benchmarks.models", description=__doc__.split("\n\n")[0],
        epilog="Forms: cupykern (convert(model), 'highest'), sgemm (as built, TF32 off), "
               "tf32 (as built, 'high'); errors against a float64 run of the first step.")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)} (default: both)")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer layers (default 12; 2 with --quick)")
    ap.add_argument("--width", type=int, default=4096, help="mlp width (default 4096)")
    ap.add_argument("--depth", type=int, default=4, help="mlp Linear->BatchNorm1d->ReLU blocks")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per form (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per form first")
    ap.add_argument("--quick", action="store_true",
                    help="small models (2 layers, hidden 256, 4x128 tokens; mlp 2x1024, "
                         "batch 256) and 3 timed steps")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args(argv)
    names = [n.strip().lower() for n in args.models.split(",") if n.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        ap.error(f"--models: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(MODELS)}")
    require_gpu()
    sizes = sizes_for(args)
    steps = 3 if args.quick and args.steps == 10 else args.steps
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name in names:
        rows += run_model(name, sizes, steps, args.warmup)
    print()
    print_rows(rows)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"meta": run_meta("python -m cupykern.benchmarks.models "
                                        + " ".join(sys.argv[1:] if argv is None else argv)),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
