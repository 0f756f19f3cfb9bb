"""kiln/errors.py: KilnError carries key, value and fix; every typed input error derives from it (and so from
ValueError); the CLI prints it as one line unless --traceback or KILN_TRACEBACK=1 asks for the traceback; kiln.fit
hands it to the caller with the traceback cut at their call."""
from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import kiln
from kiln.cli.main import main
from kiln.errors import KilnError


def test_fields_and_message():
    e = KilnError("optim.lr must be > 0, got -1.0", key="optim.lr", value=-1.0, fix="give a learning rate > 0")
    assert isinstance(e, ValueError)
    assert (e.key, e.value, e.has_value, e.fix) == ("optim.lr", -1.0, True, "give a learning rate > 0")
    assert str(e) == "optim.lr must be > 0, got -1.0; give a learning rate > 0"  # the fix appended once
    same = KilnError("x=1; use 2", key="x", fix="use 2")
    assert str(same) == "x=1; use 2"  # a fix the message already holds is not repeated
    bare = KilnError("plain")
    assert (str(bare), bare.key, bare.value, bare.has_value, bare.fix) == ("plain", None, None, False, None)
    assert KilnError("m", key="k", value=None).has_value  # None given is a value
    copied = KilnError("m", **e.fields())
    assert (copied.key, copied.value, copied.fix) == (e.key, e.value, e.fix)


def test_every_typed_input_error_is_a_kiln_error():
    from kiln.config import ConfigError
    from kiln.data.corpus import CorpusError
    from kiln.data.shards import ShardError
    from kiln.evaluate.tasks import TaskError
    from kiln.run.fit_checks import FitInputError
    from kiln.run.predict import MetricError
    from kiln.run.source import SourceError
    from kiln.train.checkpoint import CheckpointCorrupt

    for cls in (ConfigError, CorpusError, ShardError, TaskError, FitInputError, MetricError, SourceError,
                CheckpointCorrupt):
        assert issubclass(cls, KilnError) and issubclass(cls, ValueError), cls
    assert FitInputError("epochs", "epochs=0").key == "epochs"
    assert SourceError("/no/such", "does not exist").key == "/no/such"


def test_a_sections_error_keeps_its_key_as_a_config_error():
    from kiln.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, ["--optim.lr=0"])
    assert (info.value.key, info.value.value) == ("optim.lr", 0.0)
    assert str(info.value).startswith("optim.lr must be > 0, got 0.0")
    assert isinstance(info.value.__cause__, KilnError)  # where it was raised, for --traceback


ARGV = ["memory", "--out=", "--optim.lr=0"]


@pytest.mark.parametrize("how", ["flag before", "flag after", "KILN_TRACEBACK", "KILN_DEBUG"])
def test_traceback_when_asked(how, monkeypatch, capsys):
    for name in ("KILN_TRACEBACK", "KILN_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    argv = {"flag before": ["--traceback", *ARGV], "flag after": [*ARGV, "--traceback"]}.get(how, ARGV)
    if how.startswith("KILN_"):
        monkeypatch.setenv(how, "1")
    with pytest.raises(KilnError, match="optim.lr"):
        main(argv)
    assert capsys.readouterr().err == ""


def test_not_asked_is_one_line(monkeypatch, capsys):
    for name in ("KILN_TRACEBACK", "KILN_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KILN_TRACEBACK", "0")  # 0 is "no"
    assert main(ARGV) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kiln memory: error: optim.lr must be > 0, got 0.0; give a learning rate > 0, e.g. 3e-4"]


def _fit_bad_epochs(tmp_path):
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    kiln.fit(nn.Linear(3, 1), data, loss="mse", epochs=0, run_dir=tmp_path / "run",
             config={"train.device": "cpu", "log.progress": "off", "log.tensorboard": False})


def test_fit_cuts_the_traceback_at_the_call(tmp_path, monkeypatch):
    for name in ("KILN_TRACEBACK", "KILN_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(kiln.FitInputError) as info:
        _fit_bad_epochs(tmp_path)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames == ["test_fit_cuts_the_traceback_at_the_call", "_fit_bad_epochs", "entry"], frames
    assert info.value.key == "epochs" and info.value.__cause__ is None and info.value.__suppress_context__

    monkeypatch.setenv("KILN_TRACEBACK", "1")  # asked: the whole traceback, down to the raise
    with pytest.raises(kiln.FitInputError) as info:
        _fit_bad_epochs(tmp_path)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames[:3] == ["test_fit_cuts_the_traceback_at_the_call", "_fit_bad_epochs", "entry"]
    assert frames[-1] == "fit" and len(frames) == 4, frames
