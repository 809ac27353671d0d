"""The README's and docs/performance.md's current speed tables, generated from the JSON in
docs/results/ (so that the documents cannot drift from the measurements).

    python -m cupykern.benchmarks.tables           # rewrite the tables in place
    python -m cupykern.benchmarks.tables --check   # exit 1 if any table differs

Sources: ``main*.json`` (what ``python -m cupykern --json`` writes; one file per GPU,
one table each) and ``*_sweep.json`` (the envelope sweeps of ``python -m
cupykern.benchmarks.<op> --sweep``, written by :func:`cupykern.benchmark.write_sweep`).
A table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` lines; NAME is
``main`` / ``main-full`` (the main job, without / with PyTorch's times), ``envelope``
(per op: min and median ratios to PyTorch over the swept shapes, points slower than
PyTorch), ``envelope-full`` (the same per op, dtype and mode), ``slower`` (every swept
point slower than PyTorch eager or torch.compile) or ``sweep-<op>`` (every point of
``<op>_sweep.json``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/performance.md")
_BLOCK = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
_MODELS = {"l1norm": "L1Norm", "l2norm": "L2Norm",
           "matmul_sum_max_mean_logsumexp": "MatmulSumMaxMeanLogSumExp",
           "gemm_scale_batchnorm": "GemmScaleBatchNorm"}


def load(results: pathlib.Path) -> dict:
    """{"main": [(file name, data)...], "sweeps": {op file stem: data}} from ``results``."""
    files = sorted(results.glob("main*.json"), key=lambda p: (p.name != "main.json", p.name))
    main = [(p.name, json.loads(p.read_text())) for p in files]
    sweeps = {p.name.removesuffix("_sweep.json"): json.loads(p.read_text())
              for p in sorted(results.glob("*_sweep.json"))}
    return {"main": main, "sweeps": sweeps}


def _num(v, digits: int) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _provenance(meta: dict, gpu) -> str:
    bits = [f"torch {meta['torch']}" if meta.get("torch") else "",
            f"cupy {meta['cupy']}" if meta.get("cupy") else "",
            f"commit {meta['commit']}" if meta.get("commit") else "",
            meta.get("date", ""), meta.get("source", "")]
    return f"**{gpu or meta.get('gpu') or 'GPU'}** ({'; '.join(b for b in bits if b)})"


# Main-job columns: (heading, key, digits); the README's table leaves out PyTorch's times.
_MAIN = [("ms", "ms", 3), ("eager ms", "eager_ms", 3), ("compile ms", "compile_ms", 3),
         ("x eager", "speedup_eager", 2), ("x compile", "speedup_compile", 2),
         ("% copy BW", "pct_copy_bw", 1), ("TFLOP/s", "tflops", 1), ("train ms", "train_ms", 3),
         ("train x eager", "train_speedup_eager", 2), ("train x compile", "train_speedup_compile", 2)]
_COMPACT = ("eager ms", "compile ms", "train ms", "train x compile")


def main_tables(main, compact: bool = False) -> str:
    """One table per main-job JSON (one GPU each): the forward, then the training step."""
    cols = [c for c in _MAIN if not (compact and c[0] in _COMPACT)]
    out = []
    for _, data in main:
        out += [_provenance(data.get("meta", {}), data.get("gpu")), "",
                _row(["model", "shape"] + [c[0] for c in cols]), _row(["---"] * 2 + ["---:"] * len(cols))]
        for r in data["rows"]:
            out.append(_row([_MODELS.get(r["model"], r["model"]), r["case"]]
                            + [_num(r.get(key), digits) for _, key, digits in cols]))
        out.append("")
    return "\n".join(out) if out else "(no main-job results in docs/results/ yet)\n"


def _gpus(sweeps) -> str:
    return "; ".join(f"{op}: {_provenance(d.get('meta', {}), None)}" for op, d in sweeps.items())


def envelope_table(sweeps) -> str:
    """Per op (every dtype and mode of its sweep): points, min / median x eager and
    x compile, and how many points are slower than PyTorch."""
    if not sweeps:
        return "(no sweep results in docs/results/ yet)\n"
    ops: dict = {}
    for data in sweeps.values():
        for r in data["rows"]:
            ops.setdefault(r["op"], []).append(r)
    out = [_gpus(sweeps), "",
           _row(["op", "points", "min x eager", "median x eager", "min x compile",
                 "median x compile", "slower than PyTorch"]), _row(["---"] + ["---:"] * 6)]
    for op, rows in ops.items():
        e = [r["x_eager"] for r in rows]
        c = [r["x_compile"] for r in rows if r["x_compile"] is not None]
        out.append(_row([op, str(len(rows)), _num(min(e), 2), _num(statistics.median(e), 2),
                         _num(min(c) if c else None, 2), _num(statistics.median(c) if c else None, 2),
                         str(len(slower(rows)))]))
    return "\n".join(out) + "\n"


def envelope_full_table(sweeps) -> str:
    """Per op, dtype and mode (the sweeps' summaries): points, min / median x eager and
    x compile."""
    if not sweeps:
        return "(no sweep results in docs/results/ yet)\n"
    out = [_gpus(sweeps), "",
           _row(["op", "dtype", "mode", "points", "min x eager", "median x eager",
                 "min x compile", "median x compile"]),
           _row(["---"] * 3 + ["---:"] * 5)]
    for data in sweeps.values():
        for s in data["summary"]:
            out.append(_row([s["op"], s["dtype"], s["mode"], str(s["n"]),
                             _num(s["min_x_eager"], 2), _num(s["median_x_eager"], 2),
                             _num(s["min_x_compile"], 2), _num(s["median_x_compile"], 2)]))
    return "\n".join(out) + "\n"


_POINT = ["op", "shape", "dtype", "mode", "ms", "eager ms", "compile ms", "x eager",
          "x compile", "ceiling", "x ceiling"]


def _point(r) -> str:
    return _row([r["op"], r["shape"], r["dtype"], r["mode"], _num(r["ms"], 4),
                 _num(r["eager_ms"], 4), _num(r["compile_ms"], 4), _num(r["x_eager"], 2),
                 _num(r["x_compile"], 2), r["ceiling"] or "", _num(r["x_ceiling"], 2)])


def slower(rows) -> list:
    """Sweep points where PyTorch (eager or torch.compile) is faster than we are."""
    return [r for r in rows if r["x_eager"] < 1 or (r["x_compile"] or 1) < 1]


def slower_table(sweeps) -> str:
    rows = [r for d in sweeps.values() for r in slower(d["rows"])]
    if not sweeps:
        return "(no sweep results in docs/results/ yet)\n"
    if not rows:
        return "None: every swept shape is at least as fast as PyTorch eager and torch.compile.\n"
    return "\n".join([_row(_POINT), _row(["---"] * 4 + ["---:"] * 5 + ["---", "---:"])]
                     + [_point(r) for r in rows]) + "\n"


def sweep_table(data) -> str:
    return "\n".join([_provenance(data.get("meta", {}), None), "", _row(_POINT),
                      _row(["---"] * 4 + ["---:"] * 5 + ["---", "---:"])]
                     + [_point(r) for r in data["rows"]]) + "\n"


def render(name: str, results: dict) -> str:
    """The markdown of table ``name``; KeyError for an unknown name."""
    if name in ("main", "main-full"):
        return main_tables(results["main"], compact=name == "main")
    if name == "envelope":
        return envelope_table(results["sweeps"])
    if name == "envelope-full":
        return envelope_full_table(results["sweeps"])
    if name == "slower":
        return slower_table(results["sweeps"])
    if name.startswith("sweep-"):
        data = results["sweeps"].get(name.removeprefix("sweep-"))
        return sweep_table(data) if data else f"(no {name.removeprefix('sweep-')}_sweep.json yet)\n"
    raise KeyError(f"unknown table {name!r} (main, main-full, envelope, envelope-full, slower, "
                   "sweep-<op>)")


def regenerate(text: str, results: dict) -> str:
    """``text`` with every marked table rendered afresh from ``results``."""
    # (a blank line before the closing marker ends a table for every Markdown renderer)
    return _BLOCK.sub(lambda m: m.group(1) + render(m.group(2), results).rstrip("\n") + "\n\n"
                      + m.group(4), text)


def main(argv=None, root: pathlib.Path = ROOT) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupykern.benchmarks.tables",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a document's tables differ from the JSON")
    args = ap.parse_args(argv)
    results = load(root / "docs" / "results")
    stale = []
    for doc in DOCS:
        path = root / doc
        text = path.read_text()
        new = regenerate(text, results)
        if new != text:
            stale.append(doc)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("out of date with docs/results/*.json: " + ", ".join(stale)
              + " (run: python -m cupykern.benchmarks.tables)", file=sys.stderr)
        return 1
    print(("regenerated: " + ", ".join(stale)) if stale and not args.check else "tables up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
