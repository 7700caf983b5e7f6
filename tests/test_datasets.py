"""Dataset loaders (marft_jax.data.datasets) and MathTask (marft_jax.envs.math_task)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marft_jax.data.datasets import DatasetError, detect_format, load_problems
from marft_jax.envs.math_task import MathTask, hash_split
from marft_jax.envs.task import Problem, Transcript

DATA = Path(__file__).parents[1] / ".." / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is absent")


# ---------------------------------------------------------------------------------------------
# Real files
# ---------------------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize(
    "name, count, fmt",
    [
        ("math_train.json", 7500, "math"),
        ("math500.jsonl", 500, "math500"),
        ("gsm8k_test.json", 1319, "gsm8k_final"),
        ("gsm8k_train.parquet", 7473, "gsm8k"),
        ("aime2024.json", 30, "aime"),
    ],
)
def test_real_files_load_with_auto_format(name, count, fmt):
    problems = load_problems(DATA / name, empty_answer="keep")
    assert len(problems) == count
    assert problems[0].meta["format"] == fmt
    stem = name.split(".")[0]
    assert problems[0].uid == f"{stem}:0" and problems[-1].uid == f"{stem}:{count - 1}"
    assert len({p.uid for p in problems}) == count
    assert all(p.text for p in problems)
    assert sum(p.answer is None for p in problems) == (4 if name == "math_train.json" else 0)


@needs_data
def test_math_train_rows_with_empty_answers_are_skipped_by_default():
    problems = load_problems(DATA / "math_train.json")
    assert len(problems) == 7496  # 4 rows of the file have final_answer == ""
    assert all(p.answer for p in problems)
    assert problems[-1].uid == "math_train:7499"  # uids keep their row numbers
    assert "math_train:1634" not in {p.uid for p in problems}
    with pytest.raises(DatasetError, match="row 1634, field 'final_answer': empty value"):
        load_problems(DATA / "math_train.json", empty_answer="error")


@needs_data
def test_raw_latex_gold_survives_unchanged():
    rows = [json.loads(line) for line in (DATA / "math500.jsonl").read_text().splitlines()]
    problems = load_problems(DATA / "math500.jsonl")
    assert problems[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)" == rows[0]["answer"]
    assert problems[2].answer == "\\frac{14}{3}"  # never last-number extracted to "3"
    assert all(p.answer == r["answer"] for p, r in zip(problems, rows))


@needs_data
def test_gsm8k_worked_solution_gives_final_number_without_separators():
    table = pq.read_table(DATA / "gsm8k_train.parquet").to_pylist()
    problems = load_problems(DATA / "gsm8k_train.parquet")
    row = next(i for i, r in enumerate(table) if r["answer"].rstrip().endswith("#### 1,080"))
    assert problems[row].answer == "1080"
    assert problems[row].text == table[row]["question"].strip()
    assert all("####" not in p.answer and "," not in p.answer for p in problems)


@needs_data
def test_math_task_whole_file_and_hash_split():
    task = MathTask.from_files("math500", test=DATA / "math500.jsonl")
    assert task.split_size("test") == 500 and task.split_size("train") == 0
    split = MathTask.from_split("math", DATA / "math_train.json", test_fraction=0.1, split_seed=0)
    n_test = split.split_size("test")
    assert split.split_size("train") + n_test == 7496 and 600 < n_test < 900
    again = MathTask.from_split("math", DATA / "math_train.json", test_fraction=0.1, split_seed=0)
    assert [p.uid for p in again.problems("test", seed=1)] == [p.uid for p in split.problems("test", seed=1)]
    train_texts = {p.text for p in split.problems("train")}
    assert not train_texts & {p.text for p in split.problems("test")}


# ---------------------------------------------------------------------------------------------
# Small files and error cases
# ---------------------------------------------------------------------------------------------


def _write_json(path: Path, rows) -> Path:
    path.write_text(json.dumps(rows))
    return path


def test_generic_schema_with_field_mapping(tmp_path):
    path = _write_json(tmp_path / "custom.json", [{"q": " What is 2+2? ", "sol": "2+2=4\n#### 4"}])
    (p,) = load_problems(path, format="generic", problem_field="q", answer_field="sol", answer_format="gsm8k")
    assert p == Problem(uid="custom:0", text="What is 2+2?", answer="4", meta=p.meta)
    assert p.meta == {"source": str(path), "row": 0, "format": "generic"}


def test_integer_answers_are_accepted_as_strings(tmp_path):
    path = _write_json(tmp_path / "aime.json", [{"problem": "p", "final_answer": 204, "year": 2024}])
    assert load_problems(path)[0].answer == "204"


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": "\\\\frac{1}{2}"}\n')
    problems = load_problems(path)
    assert [p.uid for p in problems] == ["d:0", "d:1"] and problems[1].answer == "\\frac{1}{2}"


def test_parquet_small(tmp_path):
    path = tmp_path / "g.parquet"
    pq.write_table(pa.table({"question": ["q0", "q1"], "answer": ["x\n#### 12,345", "#### -3"]}), path)
    assert [p.answer for p in load_problems(path)] == ["12345", "-3"]


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="not found") as err:
        load_problems(tmp_path / "nope.json")
    assert "nope.json" in str(err.value)


def test_missing_field_names_file_row_and_field(tmp_path):
    path = _write_json(tmp_path / "m.json", [{"problem": "a", "final_answer": "1"}, {"problem": "b"}])
    with pytest.raises(DatasetError) as err:
        load_problems(path)
    assert isinstance(err.value, ValueError)
    assert (err.value.row, err.value.field) == (1, "final_answer")
    assert "m.json" in str(err.value) and "row 1" in str(err.value) and "'final_answer'" in str(err.value)


@pytest.mark.parametrize("content", ["[]", ""])
def test_empty_dataset(tmp_path, content):
    path = tmp_path / "empty.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match="empty|malformed"):
        load_problems(path)


def test_empty_jsonl(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DatasetError, match="empty"):
        load_problems(path)


def test_malformed_jsonl_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": \n')
    with pytest.raises(DatasetError, match="line 2") as err:
        load_problems(path)
    assert err.value.row == 1 and "bad.jsonl" in str(err.value)


def test_malformed_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"problem": "a", "answer": "1"},')
    with pytest.raises(DatasetError, match="malformed JSON"):
        load_problems(path)


@pytest.mark.parametrize(
    "rows, row, field, message",
    [
        ([{"problem": ["not", "text"], "answer": "1"}], 0, "problem", "expected a string, got list"),
        ([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}], 1, "answer", "got NoneType"),
        ([{"problem": "a", "answer": "1"}, {"problem": "", "answer": "2"}], 1, "problem", "empty value"),
        ([{"problem": "a", "answer": "1"}, ["b", "2"]], 1, None, "expected an object"),
        ([{"question": "a", "answer": "no marker"}], 0, "answer", "####"),
    ],
)
def test_wrong_types_and_bad_rows(tmp_path, rows, row, field, message):
    path = _write_json(tmp_path / "t.json", rows)
    with pytest.raises(DatasetError, match=message) as err:
        load_problems(path)
    assert (err.value.row, err.value.field) == (row, field)


def test_empty_answer_policies(tmp_path):
    path = _write_json(tmp_path / "e.json", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": " "}])
    assert [p.uid for p in load_problems(path)] == ["e:0"]
    assert [p.answer for p in load_problems(path, empty_answer="keep")] == ["1", None]
    with pytest.raises(DatasetError, match="row 1, field 'answer': empty value"):
        load_problems(path, empty_answer="error")
    only_empty = _write_json(tmp_path / "only.json", [{"problem": "b", "answer": ""}])
    with pytest.raises(DatasetError, match="empty"):
        load_problems(only_empty)
    with pytest.raises(ValueError, match="empty_answer"):
        load_problems(path, empty_answer="drop")


def test_not_a_list_and_unknown_extension_and_format(tmp_path):
    with pytest.raises(DatasetError, match="JSON list"):
        load_problems(_write_json(tmp_path / "o.json", {"problem": "a"}))
    (tmp_path / "d.csv").write_text("problem,answer\n")
    with pytest.raises(DatasetError, match="extension"):
        load_problems(tmp_path / "d.csv")
    ok = _write_json(tmp_path / "ok.json", [{"problem": "a", "answer": "1"}])
    with pytest.raises(DatasetError, match="unknown format"):
        load_problems(ok, format="nope")
    with pytest.raises(DatasetError, match="no known math schema"):
        load_problems(_write_json(tmp_path / "x.json", [{"text": "a", "label": "1"}]))


def test_detect_format():
    assert detect_format({"question": "", "answer": ""}) == "gsm8k"
    assert detect_format({"problem": "", "final_answer": "", "answer_with_process": ""}) == "gsm8k_final"
    assert detect_format({"problem": "", "final_answer": "", "id": 1, "year": 2024}) == "aime"
    assert detect_format({"problem": "", "final_answer": ""}) == "math"
    assert detect_format({"problem": "", "answer": "", "unique_id": "x"}) == "math500"
    assert detect_format({"problem": "", "answer": ""}) == "generic"
    assert detect_format({"problem": "", "solution": "", "level": "", "type": ""}) == "math_boxed"


def test_worked_solution_gives_its_last_boxed_answer(tmp_path):
    """MATH as the Hub serves it (problem, level, type, solution): the gold answer is the
    solution's last \\boxed{}, brace-balanced; a solution without one is an empty answer."""
    rows = [{"problem": "p0", "level": "Level 1", "type": "Algebra",
             "solution": "First $\\boxed{1}$, then $x=\\boxed{\\frac{1}{2}}$."},
            {"problem": "p1", "level": "Level 2", "type": "Algebra", "solution": "No box here."}]
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    problems = load_problems(path, name="math_train")
    assert [(p.uid, p.answer, p.meta["format"]) for p in problems] == [("math_train:0", "\\frac{1}{2}", "math_boxed")]
    assert [p.answer for p in load_problems(path, empty_answer="keep")] == ["\\frac{1}{2}", None]
    with pytest.raises(DatasetError, match=r"row 1, field 'solution': the worked solution has no \\boxed"):
        load_problems(path, empty_answer="error")


def test_math_task_scores_answer_agent_and_split_is_text_based(tmp_path):
    rows = [{"problem": f"problem {i}", "answer": "\\frac{14}{3}" if i == 0 else str(i)} for i in range(40)]
    path = _write_json(tmp_path / "small.json", rows)
    task = MathTask.from_split("small", path, test_fraction=0.25, split_seed=7)
    train, test = hash_split(load_problems(path), 0.25, 7)
    assert [p.uid for p in sorted(task.problems("test"), key=lambda p: p.meta["row"])] == [p.uid for p in test]
    assert len(train) + len(test) == 40 and not {p.text for p in train} & {p.text for p in test}
    problem = load_problems(path)[0]
    right = Transcript(problem, ("\\boxed{3}", "\\boxed{\\frac{14}{3}}"), answer_agent=1)
    wrong = Transcript(problem, ("\\boxed{\\frac{14}{3}}", "so 14/3 is about 3"), answer_agent=1)
    assert task.score(right).reward == 1.0
    assert task.score(wrong).reward == 0.0
    with pytest.raises(ValueError, match="split"):
        task.problems("validation")
