"""Models and datasets by their Hub names, without a network (issue 39).

A Hugging Face cache directory is built here in the documented layout
(``hub/models--org--name/{refs/main, snapshots/<commit>/}``, ``hub/datasets--org--name/...``)
with a tiny random model saved by ``transformers`` and tiny files of each pinned dataset, then
everything runs with ``HF_HUB_OFFLINE=1``: ``huggingface_hub``'s own cache lookup resolves
``model.name=marft-test/tiny`` and ``task.name=gsm8k`` (no shortcut of ours). A paper preset
trains one iteration from it as its own process with ``HF_HOME`` pointing at the directory, the
preset's model and data swapped by name only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marft_jax import hub
from marft_jax.data import hub_datasets
from marft_jax.data.hub_datasets import HUB_TASKS

ROOT = Path(__file__).resolve().parents[1]
TINY = "marft-test/tiny"
TINY_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _snapshot(hf_home: Path, kind: str, repo: str, commit: str, ref: str | None = None) -> Path:
    """``hub/<kind>s--org--name/snapshots/<commit>/`` (and ``refs/<ref>`` naming the commit)."""
    folder = hf_home / "hub" / f"{kind}s--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


def _rows(spec: hub_datasets.HubFile, n: int = 6) -> list[dict]:
    """Tiny rows in the pinned file's own schema (the columns the Hub file has)."""
    if spec.format == "gsm8k":
        return [{"question": f"Tom has {i} apples and buys 2 more. How many apples?",
                 "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"} for i in range(n)]
    if spec.format == "math_boxed":
        return [{"problem": f"What is ${i}+1$?", "level": "Level 1", "type": "Algebra",
                 "solution": f"We add: ${i}+1=\\boxed{{{i + 1}}}$."} for i in range(n)]
    if spec.format == "math500":
        return [{"problem": f"Compute $\\frac{{{i}}}{{3}}$.", "solution": "...", "answer": f"\\frac{{{i}}}{{3}}",
                 "subject": "Algebra", "level": 1, "unique_id": f"test/algebra/{i}.json"} for i in range(n)]
    if spec.format == "generic":      # AIME 2024: answers are zero-padded strings
        return [{"id": 60 + i, "problem": f"Find {i} + 20.", "solution": "...", "answer": f"0{20 + i}",
                 "url": "https://artofproblemsolving.com/wiki", "year": "2024"} for i in range(n)]
    assert spec.format == "humaneval"
    return [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
             "canonical_solution": f"    return x + {i}\n", "entry_point": f"f{i}",
             "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n"} for i in range(n)]


def _write_dataset(hf_home: Path, spec: hub_datasets.HubFile) -> None:
    path = _snapshot(hf_home, "dataset", spec.repo, spec.revision) / spec.file
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = _rows(spec)
    if spec.file.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model_dir) -> Path:
    """An HF_HOME with ``marft-test/tiny`` (refs/main -> a commit; weights saved by
    transformers, the tiny run's tokenizer) and every pinned dataset file in tiny form."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from marft_jax.bench.iteration import TINY_CONFIG

    home = tmp_path_factory.mktemp("hf_home")
    snap = _snapshot(home, "model", TINY, TINY_COMMIT, ref="main")
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_CONFIG.items() if k not in ("model_type", "architectures")})
    LlamaForCausalLM(config).save_pretrained(str(snap))
    for f in tiny_model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, snap / f.name)
    for splits in HUB_TASKS.values():
        for spec in splits.values():
            _write_dataset(home, spec)
    return home


@pytest.fixture
def offline_cache(hf_home, monkeypatch):
    """This process reads ``hf_home``'s cache, offline (the two settings huggingface_hub reads
    from HF_HOME / HF_HUB_OFFLINE at import, set on its constants module)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home


def test_pinned_table_is_complete():
    """Every named task has pinned splits; revisions are full commit hashes; docs cite each pin."""
    doc = (ROOT / "docs" / "tasks.md").read_text()
    assert set(HUB_TASKS) == {"math", "math500", "gsm8k", "aime", "humaneval"}
    for task, splits in HUB_TASKS.items():
        assert "test" in splits and ("train" in splits or task == "humaneval"), task
        for spec in splits.values():
            assert re.fullmatch(r"[0-9a-f]{40}", spec.revision), spec
            assert f"`{spec.repo}`" in doc and spec.revision in doc and spec.file in doc, spec


def test_hub_names_resolve_through_the_cache(offline_cache):
    """model.name=org/tiny and every named task load from the cache alone (HF_HUB_OFFLINE)."""
    from marft_jax.config import load_config
    from marft_jax.models.registry import load_model
    from marft_jax.train.build import build_task

    model = load_model(TINY, revision="main")
    assert Path(model.source) == offline_cache / "hub" / "models--marft-test--tiny" / "snapshots" / TINY_COMMIT
    assert model.cfg.vocab_size == 49152 and model.tokenizer.get_vocab()

    task = build_task(load_config(None, ["task.name=gsm8k"]))
    train = list(task.problems("train"))
    assert len(train) == 6 and task.split_size("test") == 6
    assert sorted(p.answer for p in train) == [str(i + 2) for i in range(6)]
    assert {p.meta["hub"] for p in train} == {"openai/gsm8k@740312add88f781978c0658806c59bc2815b9866/"
                                             "main/train-00000-of-00001.parquet"}
    assert train[0].uid.startswith("gsm8k_train:")

    math = build_task(load_config(None, ["task.name=math"]))
    assert sorted(p.answer for p in math.problems("train")) == [str(i + 1) for i in range(6)]  # last \boxed{}
    assert next(iter(math.problems("test"))).answer.startswith("\\frac{")                   # raw LaTeX
    aime = build_task(load_config(None, ["task.name=aime"]))
    assert sorted(p.answer for p in aime.problems("test")) == [f"0{20 + i}" for i in range(6)]
    code = build_task(load_config(None, ["task.name=humaneval"]))
    first = next(iter(code.problems("test")))
    assert first.meta["entry_point"].startswith("f") and "def check" in first.meta["test"]


def test_local_eval_path_overrides_the_hub_test_set(offline_cache, tmp_path):
    from marft_jax.config import load_config
    from marft_jax.train.build import build_task

    local = tmp_path / "mine.jsonl"
    local.write_text(json.dumps({"problem": "1+1?", "final_answer": "2"}) + "\n")
    task = build_task(load_config(None, ["task.name=gsm8k", f"task.eval_path={local}"]))
    assert task.split_size("train") == 6 and [p.answer for p in task.problems("test")] == ["2"]


def test_absent_offline_model_and_dataset_name_the_fetch_command(tmp_path, monkeypatch, capsys):
    """Offline with an empty cache: a clean error (exit 2, no traceback) naming the model, the
    revision and the `hf download` command; the same for a pinned dataset."""
    from huggingface_hub import constants

    from marft_jax import cli
    from marft_jax.config import load_config
    from marft_jax.train.build import build_task

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    rev = "989aa7980e4cf806f80c7fef2b1adb7bc71aa306"
    assert cli.main(["generate", "--model", "Qwen/Qwen2.5-1.5B-Instruct", "--revision", rev]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "'Qwen/Qwen2.5-1.5B-Instruct' at revision '989aa7980e4cf806f80c7fef2b1adb7bc71aa306'" in err
    assert "HF_HUB_OFFLINE=1" in err and str(tmp_path / "empty") in err
    assert f"hf download Qwen/Qwen2.5-1.5B-Instruct --revision {rev} --include config.json" in err
    assert "--include '*.safetensors'" in err and "huggingface-cli download" in err

    with pytest.raises(hub.HubError, match=r"task 'gsm8k' train data: dataset 'openai/gsm8k' at revision "
                                           r"'740312add88f781978c0658806c59bc2815b9866'.*\n  hf download "
                                           r"openai/gsm8k main/train-00000-of-00001.parquet --repo-type dataset"):
        build_task(load_config(None, ["task.name=gsm8k"]))
    # `marft-jax train paper/...` stops there too, before any model is read, with exit status 2
    assert cli.main(["train", "paper/math-duo-marft-a-qwen2.5-1.5b", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'DigitalLearningGmbH/MATH-lighteval' at revision '0530c78" in err


def test_process_zero_fetches_while_the_others_wait(monkeypatch):
    """Several processes: process 0 downloads, the others read the cache after the barrier and
    download only where that cache is not theirs; one process never waits."""
    calls = []
    monkeypatch.setattr(hub, "_barrier", lambda name: calls.append("barrier"))

    def get(local_only):
        calls.append("cache" if local_only else "download")
        if local_only and cache_missing:
            raise FileNotFoundError("not cached")
        return Path("/snap")

    for index, count, cache_missing, want in [
        (0, 1, False, ["download"]),
        (0, 4, False, ["download", "barrier"]),
        (2, 4, False, ["barrier", "cache"]),
        (2, 4, True, ["barrier", "cache", "download"]),
    ]:
        calls.clear()
        monkeypatch.setattr(hub, "_process_count", lambda: (index, count))
        assert hub.fetch("model", "a/b", "main", get, command="hf download a/b") == Path("/snap")
        assert calls == want, (index, count, cache_missing)


def test_paper_preset_trains_from_the_cache_by_name(hf_home, tmp_path):
    """`marft-jax train paper/gsm8k-...` with HF_HOME at the tiny cache and HF_HUB_OFFLINE=1: the
    preset's model is swapped by name (model.name/model.revision), its data is the pinned
    openai/gsm8k found in the cache; the rest only makes the iteration cheap."""
    over = {"model.name": TINY, "model.revision": "main",
            "rollout.rows": 2, "rollout.horizon": 1, "rollout.max_new_tokens": 6, "rollout.context_window": 512,
            "ppo.micro_batches": 1, "train.iterations": 1, "train.eval_before": "false",
            "train.eval_problems": 2, "train.eval_batch_size": 2, "train.save_every": 1, "train.scoring_workers": 0,
            "train.out_dir": str(tmp_path), "train.run_name": "hub", "train.time_budget_s": "null"}
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               JAX_PLATFORMS="cpu")
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-m", "marft_jax.cli", "train", "paper/gsm8k-duo-marft-a-qwen2.5-3b",
                          *(f"{k}={v}" for k, v in over.items())],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "team accuracy on held-out problems" in out.stdout
    assert (tmp_path / "hub" / "checkpoints" / "step_00000001").is_dir()
    metrics = [json.loads(line) for line in (tmp_path / "hub" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[0]["step"] == 1
