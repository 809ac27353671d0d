"""One benchmark per op: ``python -m cupykern.benchmarks.<op>`` (GPU machine only).

Each states its byte or FLOP model and prints percent of the same-run ceiling
next to the speedups over PyTorch eager and torch.compile.
"""
