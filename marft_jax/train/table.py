"""The paper's results table from evaluation files: methods as rows (grouped by team: Single,
Duo, Trio, ...; named and anonymous roles apart), one column per benchmark (task), cells
``mean ± standard error`` over seeds, as Markdown, CSV or LaTeX.

Input schema: every ``<run_dir>/eval/*.json`` is one result object::

    {
      "method": "MARFT-A",             # str: MARFT-A | MARFT-T | IPPO | base | single ... (free text)
      "agents": 2,                     # int >= 1
      "roles": "named",                # "named" | "anonymous"
      "benchmark": "arithmetic-l1",    # str: the column
      "seeds": [0.62, 0.60, 0.64],     # per-seed accuracy, fractions in [0, 1], non-empty
      "seed_ids": [0, 1, 2],           # optional, same length as seeds: duplicates are rejected
      "per_agent": {"planner": [0.5, 0.4, 0.6], "solver": [0.62, 0.60, 0.64]},
                                       # optional: role -> per-seed values (or one number)
      "tag": "after",                  # optional: which evaluation (the trainer writes before/after)
      "independent": false             # optional: every agent answers alone (independent PPO)
    }

``seeds`` is the team's verdict per seed: the answering agent's answer is accepted; for
independent agents, every agent's (their mean score reaches the success threshold). The cell of
an independent result is instead the mean of its per-agent accuracies (docs/algorithm.md#evaluation; per seed,
:func:`headline_seeds`), and its all-correct ``seeds`` go to a row of their own,
``"<method> (all agents correct)"``. A file without ``"independent"`` (written before the key
existed) is independent when its run's ``config.yaml`` says so (:func:`run_is_independent`),
else when its method names independent PPO or parallel team prompts. Such older files named
every untrained team alike; :func:`row_method` names them by their prompts.

Files of several runs (e.g. one run per seed) with the same (method, agents, roles, benchmark)
pool their cells. Other keys are allowed and ignored. A file that breaks the schema raises
:class:`ResultsSchemaError` naming it.

Output: :func:`aggregate` returns rows ``{"method", "agents", "roles", "cells": {benchmark:
{"mean", "std", "se", "n", "seeds"}}, "per_agent": {benchmark: {role: mean}}}`` (``std`` is the
population std, ``se`` the sample std / √n, NaN for one seed; fractions); :func:`render` lays
them out in one of :data:`FORMATS`, accuracies in percent by default, with a caption naming the
spread (``spread="se"``, default, or ``"std"``).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from marft_jax.train.repro_stats import mean_se

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


ALL_CORRECT = " (all agents correct)"       # suffix of the all-correct row of independent methods


def every_agent_answers(rec: dict, run_independent: bool | None = None) -> bool:
    """Whether a result is of independent agents, each answering alone: its ``independent`` key,
    else ``run_independent`` (:func:`run_is_independent` of its run folder), else its method's name."""
    if "independent" in rec:
        return bool(rec["independent"])
    if run_independent is not None:
        return run_independent and rec["agents"] > 1
    low = rec["method"].lower()
    return low.startswith(("independent", "ippo")) or "parallel team prompts" in low


LEGACY_UNTRAINED = "untrained base (team prompts)"     # one name for every untrained team, before 65dfbcc


def row_method(rec: dict, run_independent: bool | None = None) -> str:
    """A result's row name: its ``method``; the legacy untrained name is split by the prompts
    the team starts from, as the trainer now names them (``trainer.untrained_method``), where
    the run's config says whether its agents are independent."""
    if rec["method"] != LEGACY_UNTRAINED or run_independent is None:
        return rec["method"]
    if rec["agents"] == 1:
        return "untrained base (single-agent prompt)"
    return f"untrained base ({'parallel' if run_independent else 'chained'} team prompts)"


def run_config(run_dir: str | Path) -> dict:
    """A run folder's ``config.yaml`` as a dict (empty if absent or not a mapping)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    cfg = yaml.safe_load(path.read_text())
    return cfg if isinstance(cfg, dict) else {}


def run_is_independent(cfg: dict) -> bool | None:
    """From a run's config (:func:`run_config`): ``rollout.mode: parallel`` or ``team.graph:
    independent``; None where both keys are missing."""
    rollout, team = cfg.get("rollout") or {}, cfg.get("team") or {}
    if "mode" not in rollout and "graph" not in team:
        return None
    return rollout.get("mode") == "parallel" or team.get("graph") == "independent"


def headline_seeds(rec: dict, path: str | Path = "<result>", run_independent: bool | None = None) -> list[float]:
    """Per-seed accuracy a table reports for one result: ``seeds``, or for independent agents
    (:func:`every_agent_answers`) the mean over agents of ``per_agent`` (each role's list as long
    as ``seeds``)."""
    if not (every_agent_answers(rec, run_independent) and rec.get("per_agent")):
        return [float(s) for s in rec["seeds"]]
    n = len(rec["seeds"])
    per_role = [v if isinstance(v, list) else [v] for v in rec["per_agent"].values()]
    _check(all(len(v) == n for v in per_role), Path(path),
           f"'per_agent' of an independent result must hold {n} value(s) per role, as 'seeds' does")
    return [float(np.mean([v[k] for v in per_role])) for k in range(n)]


def result_files(run_dir: str | Path) -> list[Path]:
    """The result files of one run: ``<run_dir>/eval/*.json`` (not ``eval/periodic/``)."""
    return sorted((Path(run_dir) / EVAL_DIR).glob("*.json"))


def aggregate(run_dirs: Iterable[str | Path], tags: Sequence[str] | None = None) -> list[dict]:
    """Pool every run's ``eval/*.json`` into table rows (order: first appearance of the method,
    then agents, then named before anonymous).

    ``tags``: keep only files whose ``"tag"`` is one of these (e.g. ``["after"]``: the trained
    teams, not the untrained ``before`` evaluations); None keeps every file.
    Raises FileNotFoundError naming the directories if no (matching) file is found.
    """
    run_dirs = list(run_dirs)
    for d in run_dirs:
        if not Path(d).is_dir():
            raise FileNotFoundError(f"aggregate: run directory {str(d)!r} does not exist")
    pooled: dict[tuple, dict] = {}
    method_order: dict[str, int] = {}
    found = 0
    for run_dir in run_dirs:
        independent = run_is_independent(run_config(run_dir))
        for path in result_files(run_dir):
            rec = read_result(path)
            if tags is not None and rec.get("tag") not in tags:
                continue
            found += 1
            method = row_method(rec, independent)
            method_order.setdefault(method, len(method_order))
            parts = [(method, headline_seeds(rec, path, independent), rec.get("per_agent", {}))]
            if every_agent_answers(rec, independent) and rec.get("per_agent"):
                parts.append((method + ALL_CORRECT, [float(s) for s in rec["seeds"]], {}))
            for method, seeds, per_agent in parts:
                key = (method, rec["agents"], rec["roles"])
                cell = pooled.setdefault(key, {}).setdefault(
                    rec["benchmark"], {"seeds": [], "seed_ids": set(), "per_agent": {}, "files": []})
                if "seed_ids" in rec:
                    dup = cell["seed_ids"] & set(map(str, rec["seed_ids"]))
                    if dup:
                        raise ResultsSchemaError(
                            f"{str(path)!r}: seed ids {sorted(dup)} of {key + (rec['benchmark'],)} already "
                            f"come from {[str(f) for f in cell['files']]}")
                    cell["seed_ids"] |= set(map(str, rec["seed_ids"]))
                cell["seeds"].extend(seeds)
                cell["files"].append(path)
                for role, vals in per_agent.items():
                    cell["per_agent"].setdefault(role, []).extend(
                        float(v) for v in (vals if isinstance(vals, list) else [vals]))
    if not found:
        which = "" if tags is None else f" with tag in {list(tags)}"
        raise FileNotFoundError(f"aggregate: no eval/*.json result file{which} under "
                                + ", ".join(repr(str(d)) for d in run_dirs))
    rows = []
    for (method, agents, roles), cells in pooled.items():
        row_cells, row_per_agent = {}, {}
        for bench in sorted(cells):
            c = cells[bench]
            row_cells[bench] = cell_stats(c["seeds"])
            if c["per_agent"]:
                row_per_agent[bench] = {r: float(np.mean(v)) for r, v in c["per_agent"].items()}
        rows.append({"method": method, "agents": agents, "roles": roles,
                     "cells": row_cells, "per_agent": row_per_agent})
    rows.sort(key=lambda r: (method_order[r["method"].removesuffix(ALL_CORRECT)], r["agents"],
                             r["method"].endswith(ALL_CORRECT), ROLE_KINDS.index(r["roles"])))
    return rows


def cell_stats(seeds: Sequence[float]) -> dict:
    """One table cell from per-seed accuracies (fractions): ``mean``, ``std`` (population),
    ``se`` (sample std / √n, NaN for one seed), ``n`` and the ``seeds``."""
    values = [float(x) for x in seeds]
    mean, se = mean_se(values)
    return {"mean": mean, "std": float(np.std(values, ddof=0)), "se": se, "n": len(values), "seeds": values}


def benchmarks(rows: Sequence[dict]) -> list[str]:
    """Default column order: alphabetical (pass ``columns=`` to the writers for the paper's)."""
    return sorted({b for r in rows for b in r["cells"]})


# spread -> (short name, caption text, caption text in LaTeX)
SPREADS = {"se": ("SE", "standard error over seeds (sample std / √n)",
                  r"standard error over seeds (sample std$/\sqrt{n}$)"),
           "std": ("std", "population std over seeds", "population std over seeds")}
FORMATS = {"markdown": "md", "csv": "csv", "latex": "tex"}       # format -> file extension
TEAMS = {1: "Single", 2: "Duo", 3: "Trio", 4: "Quad"}
# Paper order within a team: untrained base, single agent, independent PPO, MARFT-A, MARFT-T, others.
_METHOD_ORDER = (("untrained", "base"), ("single",), ("independent ppo", "ippo"), ("marft-a",), ("marft-t",))


def team_name(agents: int) -> str:
    """The row group of a team size: Single, Duo, Trio, Quad, else ``"<k> agents"``."""
    return TEAMS.get(agents, f"{agents} agents")


def method_rank(method: str) -> int:
    """Position of a method within its team group (see ``_METHOD_ORDER``; unknown names last)."""
    low = method.lower()
    for rank, prefixes in enumerate(_METHOD_ORDER):
        if low.startswith(prefixes):
            return rank
    return len(_METHOD_ORDER)


def layout(rows: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """Rows grouped by team (ascending agents), ordered within a group by :func:`method_rank`,
    then input order, then named before anonymous: ``[(team name, rows), ...]``."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["agents"], method_rank(rows[i]["method"]),
                                                    i, ROLE_KINDS.index(rows[i]["roles"])))
    groups: dict[int, list[dict]] = {}
    for i in order:
        groups.setdefault(rows[i]["agents"], []).append(rows[i])
    return [(team_name(k), g) for k, g in groups.items()]


def format_cell(cell: dict | None, scale: float = 100.0, digits: int = 1, spread: str = "se",
                show_n: bool = False) -> str:
    """``mean ± spread`` (×``scale``); just the mean where the spread is undefined (SE of one
    seed); ``–`` for no cell; `` (n=k)`` appended with ``show_n``."""
    if cell is None:
        return MISSING
    text = f"{cell['mean'] * scale:.{digits}f}"
    sp = cell.get(spread)
    if sp is not None and math.isfinite(sp):
        text += f" ± {sp * scale:.{digits}f}"
    return text + (f" (n={cell['n']})" if show_n else "")


def _check_spread(spread: str) -> None:
    if spread not in SPREADS:
        raise ValueError(f"spread must be one of {list(SPREADS)}, got {spread!r}")


def _seed_counts(rows: Sequence[dict], cols: Sequence[str]) -> list[int]:
    return sorted({r["cells"][b]["n"] for r in rows for b in cols if b in r["cells"]})


def _unit(scale: float, latex: bool = False) -> str:
    return ("\\%" if latex else "%") if scale == 100 else f"x {scale:g}"


def _grid(rows: Sequence[dict], columns: Sequence[str] | None, scale: float, digits: int,
          spread: str) -> tuple[list[str], list[tuple[str, list[list[str]]]]]:
    """Columns and ``[(team, [[method, roles, cell, ...], ...]), ...]``; where the seed counts
    differ between cells, every cell shows its n."""
    _check_spread(spread)
    cols = list(columns) if columns is not None else benchmarks(rows)
    show_n = len(_seed_counts(rows, cols)) > 1
    groups = [(team, [[r["method"], r["roles"]] + [format_cell(r["cells"].get(b), scale, digits, spread, show_n)
                                                  for b in cols] for r in group])
              for team, group in layout(rows)]
    return cols, groups


def caption(rows: Sequence[dict], columns: Sequence[str] | None = None, scale: float = 100.0,
            spread: str = "se", latex: bool = False) -> str:
    """What the cells hold: the unit, the spread and the seeds per cell."""
    _check_spread(spread)
    cols = list(columns) if columns is not None else benchmarks(rows)
    ns = _seed_counts(rows, cols)
    seeds = (f"n = {ns[0]} seed{'s' if ns[0] != 1 else ''} per cell" if len(ns) == 1
             else "seeds per cell in brackets")
    missing = "--" if latex else MISSING
    pm = "$\\pm$" if latex else "±"
    lq, rq = ("``", "''") if latex else ('"', '"')
    independent = (f" Independent agents: the mean of the per-agent accuracies; {lq}all agents correct{rq}: "
                   "every agent's answer accepted." if any(r["method"].endswith(ALL_CORRECT) for r in rows) else "")
    return (f"Accuracy ({_unit(scale, latex)}), mean {pm} {SPREADS[spread][2 if latex else 1]}; {seeds}; "
            f"{missing}: not run.{independent}")


def to_markdown(rows: Sequence[dict], columns: Sequence[str] | None = None,
                scale: float = 100.0, digits: int = 1, spread: str = "se") -> str:
    """A GitHub Markdown table (team shown on its group's first row) and its caption below."""
    cols, groups = _grid(rows, columns, scale, digits, spread)
    esc = lambda s: str(s).replace("|", "\\|")
    lines = ["| " + " | ".join(map(esc, ["team", "method", "roles"] + cols)) + " |",
             "|" + "|".join(["---"] * 3 + ["---:"] * len(cols)) + "|"]
    for team, body in groups:
        for k, row in enumerate(body):
            lines.append("| " + " | ".join(map(esc, [team if k == 0 else ""] + row)) + " |")
    return "\n".join(lines) + "\n\n" + caption(rows, cols, scale, spread) + "\n"


def to_csv(rows: Sequence[dict], columns: Sequence[str] | None = None,
           scale: float = 100.0, digits: int = 1, spread: str = "se") -> str:
    """The same layout as CSV (UTF-8; the team on every row); benchmark headers name the
    cells' unit and spread, e.g. ``arithmetic (% mean ± SE)``."""
    cols, groups = _grid(rows, columns, scale, digits, spread)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["team", "method", "roles"] + [f"{b} ({_unit(scale)} mean ± {SPREADS[spread][0]})" for b in cols])
    for team, body in groups:
        w.writerows([team] + row for row in body)
    return buf.getvalue()


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _tex(text: str) -> str:
    text = "".join(_TEX.get(ch, ch) for ch in str(text))
    return text.replace(" ± ", r" $\pm$ ").replace(MISSING, "--")


def to_latex(rows: Sequence[dict], columns: Sequence[str] | None = None,
             scale: float = 100.0, digits: int = 1, spread: str = "se") -> str:
    """A LaTeX ``table`` (booktabs rules: ``\\usepackage{booktabs}``), one ``\\midrule`` between
    team groups, the team named on its group's first row, the caption on top."""
    cols, groups = _grid(rows, columns, scale, digits, spread)
    lines = ["% written by marft-jax table; needs \\usepackage{booktabs}",
             "\\begin{table}[t]", "\\centering",
             f"\\caption{{{caption(rows, cols, scale, spread, latex=True)}}}",
             "\\begin{tabular}{lll" + "r" * len(cols) + "}", "\\toprule",
             " & ".join(["Team", "Method", "Roles"] + [_tex(c) for c in cols]) + r" \\"]
    for team, body in groups:
        lines.append("\\midrule")
        for k, row in enumerate(body):
            lines.append(" & ".join([_tex(team) if k == 0 else ""] + [_tex(c) for c in row]) + r" \\")
    lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
    return "\n".join(lines) + "\n"


_WRITERS = {"markdown": to_markdown, "csv": to_csv, "latex": to_latex}


def render(rows: Sequence[dict], fmt: str = "markdown", **kw) -> str:
    """The table in ``fmt`` (one of :data:`FORMATS`); ``kw``: columns, scale, digits, spread."""
    if fmt not in _WRITERS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")
    return _WRITERS[fmt](rows, **kw)


def write_table(run_dirs: Iterable[str | Path], out_dir: str | Path, stem: str = "results",
                scale: float = 100.0, digits: int = 1, formats: Sequence[str] = ("markdown", "csv"),
                tags: Sequence[str] | None = None, spread: str = "se") -> tuple[Path, ...]:
    """Aggregate ``run_dirs`` (:func:`aggregate`, ``tags``) and write ``out_dir/<stem>.<ext>`` for
    each of ``formats`` (extensions in :data:`FORMATS`); returns the paths in that order."""
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {bad[0]!r}")
    _check_spread(spread)
    rows = aggregate(list(run_dirs), tags)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{stem}.{FORMATS[fmt]}"
        path.write_text(render(rows, fmt, scale=scale, digits=digits, spread=spread), encoding="utf-8")
        paths.append(path)
    return tuple(paths)
