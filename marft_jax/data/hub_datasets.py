"""The pinned Hub datasets of the named tasks: one table, fetched through ``huggingface_hub``.

``task.name`` = ``math``, ``math500``, ``gsm8k``, ``aime`` or ``humaneval`` with no
``task.path`` reads its splits from :data:`HUB_TASKS`: a dataset repository, a commit and one
file per split, fetched into the standard Hugging Face cache (``HF_HOME``; offline with
``HF_HUB_OFFLINE=1`` the cache alone is read, :mod:`marft_jax.hub`). The files are read with
``pyarrow`` / ``json`` by :func:`marft_jax.data.datasets.load_problems`, the same loader and
schemas as local files.

Why ``huggingface_hub`` + ``pyarrow`` and not ``datasets``: both are dependencies already
(``transformers`` needs the first; the parquet loader the second), one file per split is all a
task reads, and the files stay the repository's own (a ``datasets`` Arrow cache is a second
copy in another layout, and the package would add ~10 dependencies). docs/tasks.md lists each
pin and the public page it was checked against.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from marft_jax import hub
from marft_jax.envs.task import Problem


@dataclasses.dataclass(frozen=True)
class HubFile:
    """One split of a task: ``file`` of dataset repository ``repo`` at commit ``revision``.

    Attributes:
      format: the :data:`marft_jax.data.datasets.FORMATS` schema of its rows (``"humaneval"``:
        read by :func:`marft_jax.envs.code_task.load_humaneval`).
      rows: the rows of the file at this revision (the problems may be fewer: rows without a
        gold answer are skipped).
      name: the problems' uid prefix (``f"{name}:{row}"``).
    """

    repo: str
    revision: str
    file: str
    format: str
    rows: int
    name: str

    def command(self) -> str:
        """The ``hf download`` command that caches the file."""
        return hub.download_command(self.repo, self.revision, repo_type="dataset", files=[self.file])


MATH_TRAIN = HubFile("DigitalLearningGmbH/MATH-lighteval", "0530c78699ea5e8eb5530600900e1f328b48acad",
                     "data/train-00000-of-00001.parquet", "math_boxed", 7500, "math_train")
MATH_500 = HubFile("HuggingFaceH4/MATH-500", "6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be",
                   "test.jsonl", "math500", 500, "math500")
GSM8K_TRAIN = HubFile("openai/gsm8k", "740312add88f781978c0658806c59bc2815b9866",
                      "main/train-00000-of-00001.parquet", "gsm8k", 7473, "gsm8k_train")
GSM8K_TEST = HubFile("openai/gsm8k", "740312add88f781978c0658806c59bc2815b9866",
                     "main/test-00000-of-00001.parquet", "gsm8k", 1319, "gsm8k_test")
AIME_2024 = HubFile("HuggingFaceH4/aime_2024", "2fe88a2f1091d5048c0f36abc874fb997b3dd99a",
                    "data/train-00000-of-00001.parquet", "generic", 30, "aime2024")
HUMANEVAL = HubFile("openai/openai_humaneval", "7dce6050a7d6d172f3cc5c32aa97f52fa1a2e544",
                    "openai_humaneval/test-00000-of-00001.parquet", "humaneval", 164, "humaneval")

# task.name -> split -> file. MATH-500 and AIME 2024 are evaluation sets: their tasks train on
# MATH's training split (AIME problems are too few to train on). HumanEval is one set for both.
HUB_TASKS: dict[str, dict[str, HubFile]] = {
    "math": {"train": MATH_TRAIN, "test": MATH_500},
    "math500": {"train": MATH_TRAIN, "test": MATH_500},
    "gsm8k": {"train": GSM8K_TRAIN, "test": GSM8K_TEST},
    "aime": {"train": MATH_TRAIN, "test": AIME_2024},
    "humaneval": {"test": HUMANEVAL},
}


def hub_file(task: str, split: str) -> tuple[HubFile, Path]:
    """The pinned file of ``task``'s ``split`` and its path in the Hugging Face cache.

    Raises:
      KeyError: no Hub dataset is pinned for ``task``/``split``.
      marft_jax.hub.HubError: not cached offline, or the Hub cannot be reached (the message
        names the repository, the revision and the ``hf download`` command).
    """
    spec = HUB_TASKS[task][split]
    path = hub.file(f"task {task!r} {split} data: dataset", spec.repo, spec.revision, spec.file)
    return spec, path


def hub_problems(task: str, split: str) -> list[Problem]:
    """``task``'s ``split`` problems from its pinned Hub file (:func:`hub_file`), loaded with
    :func:`marft_jax.data.datasets.load_problems` (``meta["hub"]`` = ``repo@revision/file``)."""
    from marft_jax.data.datasets import load_problems

    spec, path = hub_file(task, split)
    problems = load_problems(path, format=spec.format, name=spec.name)
    where = f"{spec.repo}@{spec.revision}/{spec.file}"
    return [dataclasses.replace(p, meta={**p.meta, "hub": where}) for p in problems]
