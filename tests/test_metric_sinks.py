"""Metric sinks chosen by ``train.loggers``: selection, config errors, and the W&B sink against a
fake ``wandb`` module (no network; a real offline run only where wandb is installed)."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from marft_jax.config import ConfigError, load_config
from marft_jax.train import metric_sinks as S
from marft_jax.train import trainer
from marft_jax.train.build import check_names
from marft_jax.train.metrics import MetricsWriter


class FakeRun:
    def __init__(self, **init_kwargs):
        self.init_kwargs, self.logged, self.finished = init_kwargs, [], 0

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` module whose ``init`` records its arguments and returns a :class:`FakeRun`."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(FakeRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return module


def test_default_loggers_and_selection_from_config(tmp_path):
    assert load_config().train.loggers == ["jsonl", "tensorboard"] == list(S.DEFAULT_LOGGERS)
    cfg = load_config(None, ["train.loggers=[jsonl]"])
    assert cfg.train.loggers == ["jsonl"]
    with MetricsWriter(tmp_path / "a", cfg.train.loggers) as w:
        assert [type(s) for s in w.sinks] == [S.JsonlSink]
        w.write(1, {"x": 1.0})
    assert not (tmp_path / "a" / S.TB_DIR).exists() and S.read_metrics(tmp_path / "a")[0]["x"] == 1.0
    with MetricsWriter(tmp_path / "b", load_config().train.loggers) as w:
        assert [type(s) for s in w.sinks] == [S.JsonlSink, S.TensorBoardSink]


@pytest.mark.parametrize("value, match", [
    ("[jsonl,mlflow]", r"train\.loggers=.*unknown: \['mlflow'\]"),
    ("[tensorboard]", r"train\.loggers=.*includes jsonl"),
    ("[jsonl,jsonl]", r"train\.loggers=.*without repeats"),
])
def test_bad_loggers_are_config_errors_naming_the_key(value, match):
    with pytest.raises(ConfigError, match=match):
        check_names(load_config(None, [f"train.loggers={value}"]))


def test_bad_wandb_mode_names_the_key():
    with pytest.raises(ConfigError, match=r"train\.wandb\.mode='cloud'.*offline"):
        check_names(load_config(None, ["train.wandb.mode=cloud"]))
    assert check_names(load_config(None, ["train.wandb.mode=offline"])).train.wandb.mode == "offline"


def test_open_sinks_rejects_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="unknown: \\['csv'\\]"):
        MetricsWriter(tmp_path, ["jsonl", "csv"])


def test_missing_wandb_fails_at_start_up_naming_key_and_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)        # `import wandb` raises ImportError
    S.require_installed(["jsonl", "tensorboard"])          # nothing optional asked for: fine
    cfg = load_config(None, ["train.loggers=[jsonl,wandb]"])

    def no_work(*args, **kwargs):
        raise AssertionError("training started before the logger check")

    monkeypatch.setattr(trainer, "build_run", no_work)
    monkeypatch.setattr(trainer, "run_dir_for", no_work)
    with pytest.raises(ConfigError, match=r"train\.loggers names 'wandb'.*pip install 'marft-jax\[wandb\]'"):
        trainer.train(cfg)


def test_wandb_sink_offline_logs_each_step_and_finishes(tmp_path, fake_wandb):
    run_dir = tmp_path / "demo-run"
    options = {"wandb": {"project": "p", "config": {"train": {"seed": 3}}}}
    with MetricsWriter(run_dir, ["jsonl", "wandb"], options=options) as w:
        (run,) = fake_wandb.runs
        assert run.init_kwargs == {"project": "p", "name": "demo-run", "dir": str(run_dir), "mode": "offline",
                                   "config": {"train": {"seed": 3}}}
        w.write(1, {"episode/accuracy": np.float32(0.5), "tag": "x", "hist": np.array([1.0, 2.0])})
        w.write(2, {"episode/accuracy": 0.75, "critic/value_loss": float("nan")})
        w.write(2, {"eval/accuracy": 1.0})                  # the loop logs the evaluation at the same step
        assert run.finished == 0
    assert run.finished == 1
    steps = [s for s, _ in run.logged]
    assert steps == [1, 2, 2]
    assert run.logged[0][1] == {"episode/accuracy": 0.5}   # strings and lists stay in metrics.jsonl only
    assert run.logged[1][1]["episode/accuracy"] == 0.75 and np.isnan(run.logged[1][1]["critic/value_loss"])
    assert run.logged[2][1] == {"eval/accuracy": 1.0}
    rows = [json.loads(l) for l in (run_dir / S.METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 2] and rows[0]["hist"] == [1.0, 2.0]


def test_wandb_mode_dir_and_name_settings(tmp_path, fake_wandb, monkeypatch):
    opts = {"project": "p", "name": "n", "dir": str(tmp_path / "wb")}
    MetricsWriter(tmp_path / "r1", ["jsonl", "wandb"], options={"wandb": opts}).close()
    monkeypatch.setenv("WANDB_MODE", "disabled")            # the environment picks the mode when unset
    MetricsWriter(tmp_path / "r2", ["jsonl", "wandb"], options={"wandb": opts}).close()
    MetricsWriter(tmp_path / "r3", ["jsonl", "wandb"], options={"wandb": {**opts, "mode": "offline"}}).close()
    got = [(r.init_kwargs["mode"], r.init_kwargs["dir"], r.init_kwargs["name"]) for r in fake_wandb.runs]
    assert got == [(m, str(tmp_path / "wb"), "n") for m in ("offline", "disabled", "offline")]
    assert (tmp_path / "wb").is_dir()


def test_only_the_primary_process_opens_sinks(tmp_path, fake_wandb):
    with MetricsWriter(tmp_path, ["jsonl", "tensorboard", "wandb"], enabled=False) as w:
        rec = w.write(1, {"x": 2.0})
    assert rec["x"] == 2.0 and rec["step"] == 1
    assert fake_wandb.runs == [] and not tmp_path.joinpath(S.METRICS_FILE).exists()
    assert not tmp_path.joinpath(S.TB_DIR).exists()


def test_real_wandb_offline_run(tmp_path, monkeypatch):
    """Smoke test of the real package, offline (skips where the wandb extra is not installed)."""
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsWriter(tmp_path, ["jsonl", "wandb"], options={"wandb": {"project": "marft-jax-test"}}) as w:
        for step in (1, 2):
            w.write(step, {"episode/accuracy": 0.5 * step})
    (offline_run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert any(offline_run.glob("*.wandb"))
