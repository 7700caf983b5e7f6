"""Math dataset loaders: JSON (a list of objects), JSONL and parquet files -> ``list[Problem]``.

Supported schemas (``format=``):

==========  ===========================  ======================================================
format      fields                       answer handling
==========  ===========================  ======================================================
math        ``problem``, ``final_answer``  used as given (pre-extracted)
math500     ``problem``, ``answer``       raw LaTeX, used as given
gsm8k       ``question``, ``answer``      worked solution; text after ``####``, no ``,``
gsm8k_final ``problem``, ``final_answer``  pre-extracted GSM8K answer, used as given
aime        ``problem``, ``final_answer``  used as given
math_boxed  ``problem``, ``solution``     worked solution; content of its last ``\\boxed{}``
generic     ``problem``, ``answer``       configurable: ``problem_field``, ``answer_field``,
                                         ``answer_format`` (``raw`` | ``gsm8k`` | ``boxed``)
==========  ===========================  ======================================================

``format="auto"`` picks a schema from the first row's fields. Rows with an empty answer string
are skipped with a warning by default (``empty_answer=``; MATH train has 4 such rows; a worked
solution without a ``\\boxed{}`` counts as empty). Every problem gets ``uid = f"{name}:{row}"``
(``name`` defaults to the file stem; row = 0-based record index) and ``meta`` with the source
path, row and format. Errors are :class:`DatasetError` (a ``ValueError``) naming file, row and field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from marft_jax.envs.math_grading import gsm8k_final_answer, last_boxed
from marft_jax.envs.task import Problem

logger = logging.getLogger(__name__)
EMPTY_ANSWER_POLICIES = ("skip", "keep", "error")
ANSWER_FORMATS = ("raw", "gsm8k", "boxed")

class DatasetError(ValueError):
    """A dataset file is missing, empty, malformed, or lacks a required field."""

    def __init__(self, path: str | Path, message: str, *, row: int | None = None, field: str | None = None):
        self.path, self.row, self.field = str(path), row, field
        where = f"{path}"
        if row is not None:
            where += f", row {row}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {message}")


@dataclasses.dataclass(frozen=True)
class Schema:
    """Where a format keeps its problem text and gold answer.

    Attributes:
      problem_field: key of the problem text.
      answer_field: key of the gold answer.
      answer_format: ``"raw"`` (used as given), ``"gsm8k"`` (worked solution ending ``#### N``) or
        ``"boxed"`` (worked solution; the content of its last ``\\boxed{}``).
    """

    problem_field: str
    answer_field: str
    answer_format: str = "raw"

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {self.answer_format!r}")


FORMATS: dict[str, Schema] = {
    "math": Schema("problem", "final_answer"),
    "math500": Schema("problem", "answer"),
    "gsm8k": Schema("question", "answer", "gsm8k"),
    "gsm8k_final": Schema("problem", "final_answer"),
    "aime": Schema("problem", "final_answer"),
    "math_boxed": Schema("problem", "solution", "boxed"),
    "generic": Schema("problem", "answer"),
}


def detect_format(row: dict[str, Any]) -> str:
    """Name of the schema matching a row's fields (see module docstring).

    Raises:
      ValueError: when no known schema fits.
    """
    keys = set(row)
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if {"problem", "final_answer"} <= keys:
        if "answer_with_process" in keys:
            return "gsm8k_final"
        if {"year", "url"} & keys:
            return "aime"
        return "math"
    if {"problem", "answer"} <= keys:
        return "math500" if {"unique_id", "subject"} & keys else "generic"
    if {"problem", "solution"} <= keys:
        return "math_boxed"
    raise ValueError(f"no known math schema fits fields {sorted(keys)}; pass format= and field names")


def read_records(path: str | Path) -> list[Any]:
    """Raw records of a ``.json`` (top-level list), ``.jsonl`` or ``.parquet`` file.

    Raises:
      DatasetError: missing file, unknown extension, unreadable or malformed content.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(path, "file not found")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            where = f"line {exc.lineno}, column {exc.colno}"
            raise DatasetError(path, f"malformed JSON at {where}: {exc.msg}") from exc
        if not isinstance(data, list):
            raise DatasetError(path, f"expected a JSON list of objects, got {type(data).__name__}")
        return data
    if suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    path, f"malformed JSON on line {lineno}: {exc.msg}", row=len(records)
                ) from exc
        return records
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(path, f"cannot read parquet: {exc}") from exc
    raise DatasetError(path, f"unsupported file extension {suffix!r} (use .json, .jsonl or .parquet)")


def _text_field(path: Path, row: int, record: dict[str, Any], field: str, *, allow_empty: bool = False) -> str:
    """A required string field (integers are accepted and converted); non-empty unless allowed."""
    if field not in record:
        raise DatasetError(path, f"missing field (row has {sorted(record)})", row=row, field=field)
    value = record[field]
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise DatasetError(path, f"expected a string, got {type(value).__name__}", row=row, field=field)
    if not value.strip() and not allow_empty:
        raise DatasetError(path, "empty value", row=row, field=field)
    return value


def load_problems(
    path: str | Path,
    *,
    format: str = "auto",
    problem_field: str | None = None,
    answer_field: str | None = None,
    answer_format: str | None = None,
    empty_answer: str = "skip",
    limit: int | None = None,
    name: str | None = None,
) -> list[Problem]:
    """Load a math dataset file as problems with gold answers.

    Args:
      path: ``.json`` / ``.jsonl`` / ``.parquet`` file.
      format: a key of :data:`FORMATS` or ``"auto"`` (detected from the first row).
      problem_field, answer_field, answer_format: override the schema's fields (any format).
      empty_answer: what to do with a row whose answer is an empty string (MATH train has 4):
        ``"skip"`` it with a warning (uids keep their row numbers), ``"keep"`` it with
        ``answer=None``, or raise (``"error"``). A *missing* answer field is always an error.
      limit: keep only the first ``limit`` rows (after validation of those rows).
      name: the uid prefix (default: the file's stem).

    Returns:
      ``list[Problem]`` in file order; ``answer`` is the gold answer string, ``meta`` has
      ``source``, ``row`` and ``format``.

    Raises:
      DatasetError: missing/empty file, malformed rows, missing or mistyped fields, or a GSM8K
        solution without ``####``; the message names the file, row and field.
    """
    path = Path(path)
    if empty_answer not in EMPTY_ANSWER_POLICIES:
        raise ValueError(f"empty_answer must be one of {EMPTY_ANSWER_POLICIES}, got {empty_answer!r}")
    records = read_records(path)
    if not records:
        raise DatasetError(path, "dataset is empty")
    if limit is not None:
        records = records[:limit]
    if not isinstance(records[0], dict):
        raise DatasetError(path, f"expected an object, got {type(records[0]).__name__}", row=0)
    if format == "auto":
        try:
            format = detect_format(records[0])
        except ValueError as exc:
            raise DatasetError(path, str(exc), row=0) from exc
    if format not in FORMATS:
        raise DatasetError(path, f"unknown format {format!r}; choose from {sorted(FORMATS)} or 'auto'")
    base = FORMATS[format]
    schema = Schema(
        problem_field or base.problem_field,
        answer_field or base.answer_field,
        answer_format or base.answer_format,
    )
    problems, skipped = [], []
    for row, record in enumerate(records):
        if not isinstance(record, dict):
            raise DatasetError(path, f"expected an object, got {type(record).__name__}", row=row)
        text = _text_field(path, row, record, schema.problem_field)
        answer: str | None = _text_field(
            path, row, record, schema.answer_field, allow_empty=empty_answer != "error"
        )
        if schema.answer_format == "boxed" and answer.strip():
            answer = last_boxed(answer) or ""
            if not answer and empty_answer == "error":
                raise DatasetError(path, "the worked solution has no \\boxed{} answer", row=row,
                                   field=schema.answer_field)
        if not answer.strip():
            if empty_answer == "skip":
                skipped.append(row)
                continue
            answer = None
        elif schema.answer_format == "gsm8k":
            try:
                answer = gsm8k_final_answer(answer)
            except ValueError as exc:
                raise DatasetError(path, str(exc), row=row, field=schema.answer_field) from exc
        else:
            answer = answer.strip()
        problems.append(
            Problem(
                uid=f"{name or path.stem}:{row}",
                text=text.strip(),
                answer=answer,
                meta={"source": str(path), "row": row, "format": format},
            )
        )
    if skipped:
        logger.warning(
            "%s: skipped %d rows with an empty %r: rows %s",
            path, len(skipped), schema.answer_field, skipped[:20],
        )
    if not problems:
        raise DatasetError(path, "dataset is empty after skipping rows with an empty answer")
    return problems
