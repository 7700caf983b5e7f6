"""The paper's results table from evaluation files: rows method × agents × roles, one column per
benchmark, cells ``mean ± std`` over seeds (population std, as reference §12), Markdown and CSV.

Input schema: every ``<run_dir>/eval/*.json`` is one result object::

    {
      "method": "MARFT-A",             # str: MARFT-A | MARFT-T | IPPO | base | single ... (free text)
      "agents": 2,                     # int >= 1
      "roles": "named",                # "named" | "anonymous"
      "benchmark": "arithmetic-l1",    # str: the column
      "seeds": [0.62, 0.60, 0.64],     # per-seed accuracy, fractions in [0, 1], non-empty
      "seed_ids": [0, 1, 2],           # optional, same length as seeds: duplicates are rejected
      "per_agent": {"planner": [0.5, 0.4, 0.6], "solver": [0.62, 0.60, 0.64]}
                                       # optional: role -> per-seed values (or one number)
    }

Files of several runs (e.g. one run per seed) with the same (method, agents, roles, benchmark)
pool their ``seeds``. Other keys are allowed and ignored. A file that breaks the schema raises
:class:`ResultsSchemaError` naming it.

Output: :func:`aggregate` returns rows ``{"method", "agents", "roles", "cells": {benchmark:
{"mean", "std", "n", "seeds"}}, "per_agent": {benchmark: {role: mean}}}``;
:func:`to_markdown` / :func:`to_csv` lay them out with accuracies in percent by default.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

EVAL_DIR = "eval"
ROLE_KINDS = ("named", "anonymous")
MISSING = "–"


class ResultsSchemaError(ValueError):
    """An evaluation result file does not follow the schema (names the file and the key)."""


def _check(ok: bool, path: Path, msg: str) -> None:
    if not ok:
        raise ResultsSchemaError(f"{str(path)!r}: {msg}")


def _is_acc(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0.0 <= x <= 1.0


def read_result(path: str | Path) -> dict:
    """Load and validate one result file (see the module docstring)."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsSchemaError(f"{str(path)!r}: cannot read JSON ({e})") from e
    _check(isinstance(rec, dict), path, "must hold a JSON object")
    for key in ("method", "agents", "roles", "benchmark", "seeds"):
        _check(key in rec, path, f"missing key {key!r}")
    _check(isinstance(rec["method"], str) and rec["method"] != "", path, "'method' must be a non-empty string")
    _check(isinstance(rec["benchmark"], str) and rec["benchmark"] != "", path, "'benchmark' must be a non-empty string")
    _check(isinstance(rec["agents"], int) and not isinstance(rec["agents"], bool) and rec["agents"] >= 1,
           path, f"'agents' must be an integer >= 1, got {rec['agents']!r}")
    _check(rec["roles"] in ROLE_KINDS, path, f"'roles' must be one of {list(ROLE_KINDS)}, got {rec['roles']!r}")
    seeds = rec["seeds"]
    _check(isinstance(seeds, list) and len(seeds) > 0, path, "'seeds' must be a non-empty list of accuracies")
    _check(all(_is_acc(s) for s in seeds), path, f"'seeds' must hold accuracies in [0, 1], got {seeds!r}")
    if "seed_ids" in rec:
        ids = rec["seed_ids"]
        _check(isinstance(ids, list) and len(ids) == len(seeds), path, "'seed_ids' must be a list as long as 'seeds'")
        _check(len(set(map(str, ids))) == len(ids), path, f"'seed_ids' has duplicates: {ids!r}")
    per_agent = rec.get("per_agent", {})
    _check(isinstance(per_agent, dict), path, "'per_agent' must map role -> values")
    for role, vals in per_agent.items():
        vals = vals if isinstance(vals, list) else [vals]
        _check(len(vals) > 0 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals),
               path, f"'per_agent'[{role!r}] must be a number or a list of numbers")
    return rec


def result_files(run_dir: str | Path) -> list[Path]:
    return sorted((Path(run_dir) / EVAL_DIR).glob("*.json"))


def aggregate(run_dirs: Iterable[str | Path]) -> list[dict]:
    """Pool every run's ``eval/*.json`` into table rows (order: first appearance of the method,
    then agents, then named before anonymous). Raises FileNotFoundError if no file is found."""
    run_dirs = list(run_dirs)
    pooled: dict[tuple, dict] = {}
    method_order: dict[str, int] = {}
    found = 0
    for run_dir in run_dirs:
        for path in result_files(run_dir):
            rec = read_result(path)
            found += 1
            method_order.setdefault(rec["method"], len(method_order))
            key = (rec["method"], rec["agents"], rec["roles"])
            cell = pooled.setdefault(key, {}).setdefault(
                rec["benchmark"], {"seeds": [], "seed_ids": set(), "per_agent": {}, "files": []})
            if "seed_ids" in rec:
                dup = cell["seed_ids"] & set(map(str, rec["seed_ids"]))
                if dup:
                    raise ResultsSchemaError(
                        f"{str(path)!r}: seed ids {sorted(dup)} of {key + (rec['benchmark'],)} already "
                        f"come from {[str(f) for f in cell['files']]}")
                cell["seed_ids"] |= set(map(str, rec["seed_ids"]))
            cell["seeds"].extend(float(s) for s in rec["seeds"])
            cell["files"].append(path)
            for role, vals in rec.get("per_agent", {}).items():
                cell["per_agent"].setdefault(role, []).extend(
                    float(v) for v in (vals if isinstance(vals, list) else [vals]))
    if not found:
        raise FileNotFoundError("aggregate: no eval/*.json result file under "
                                + ", ".join(repr(str(d)) for d in run_dirs))
    rows = []
    for (method, agents, roles), cells in pooled.items():
        row_cells, row_per_agent = {}, {}
        for bench in sorted(cells):
            c = cells[bench]
            seeds = np.asarray(c["seeds"], np.float64)
            row_cells[bench] = {"mean": float(seeds.mean()), "std": float(seeds.std(ddof=0)),
                                "n": int(seeds.size), "seeds": c["seeds"]}
            if c["per_agent"]:
                row_per_agent[bench] = {r: float(np.mean(v)) for r, v in c["per_agent"].items()}
        rows.append({"method": method, "agents": agents, "roles": roles,
                     "cells": row_cells, "per_agent": row_per_agent})
    rows.sort(key=lambda r: (method_order[r["method"]], r["agents"], ROLE_KINDS.index(r["roles"])))
    return rows


def benchmarks(rows: Sequence[dict]) -> list[str]:
    """Default column order: alphabetical (pass ``columns=`` to the writers for the paper's)."""
    return sorted({b for r in rows for b in r["cells"]})


def format_cell(cell: dict | None, scale: float = 100.0, digits: int = 1) -> str:
    if cell is None:
        return MISSING
    return f"{cell['mean'] * scale:.{digits}f} ± {cell['std'] * scale:.{digits}f}"


def _table(rows: Sequence[dict], columns: Sequence[str] | None, scale: float, digits: int) -> tuple[list, list]:
    cols = list(columns) if columns is not None else benchmarks(rows)
    header = ["method", "agents", "roles"] + cols
    body = [[r["method"], str(r["agents"]), r["roles"]]
            + [format_cell(r["cells"].get(b), scale, digits) for b in cols] for r in rows]
    return header, body


def to_markdown(rows: Sequence[dict], columns: Sequence[str] | None = None,
                scale: float = 100.0, digits: int = 1) -> str:
    """A GitHub Markdown table; cells ``mean ± std`` (×``scale``, default percent), ``–`` if absent."""
    header, body = _table(rows, columns, scale, digits)
    esc = lambda s: str(s).replace("|", "\\|")
    lines = ["| " + " | ".join(map(esc, header)) + " |",
             "|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|"]
    lines += ["| " + " | ".join(map(esc, row)) + " |" for row in body]
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[dict], columns: Sequence[str] | None = None,
           scale: float = 100.0, digits: int = 1) -> str:
    """The same layout as CSV (UTF-8 text; cells ``mean ± std``)."""
    header, body = _table(rows, columns, scale, digits)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(body)
    return buf.getvalue()


def write_table(run_dirs: Iterable[str | Path], out_dir: str | Path, stem: str = "results",
                scale: float = 100.0, digits: int = 1) -> tuple[Path, Path]:
    """Aggregate ``run_dirs`` and write ``out_dir/<stem>.md`` and ``out_dir/<stem>.csv``."""
    rows = aggregate(list(run_dirs))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, cs = out_dir / f"{stem}.md", out_dir / f"{stem}.csv"
    md.write_text(to_markdown(rows, scale=scale, digits=digits), encoding="utf-8")
    cs.write_text(to_csv(rows, scale=scale, digits=digits), encoding="utf-8")
    return md, cs
