"""`benchmarks/random_model.py`: a random model of a given model's architecture (and of another size),
which the device benchmarks run on because the bundled model cannot travel there."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from sessions.engine import Engine
from sessions.model_source import load_model

REPO = Path(__file__).resolve().parent.parent


def _random_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("random_model", REPO / "benchmarks" / "random_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_model_keeps_the_tokenizer_and_overrides_the_shape(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bigger"
    overrides = {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 3}
    params = _random_model().write_random_model(tiny_model_dir, out, torch.bfloat16, overrides, 0, "cpu")

    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in overrides} == overrides
    assert config["head_dim"] == 16  # hidden_size / heads, as the config's own default
    assert params > 0
    engine = Engine(load_model(str(out), tmp_path / "cache", "cpu", "bfloat16"))
    assert engine.layout.num_model_layers == 3
    assert engine.tokenizer.encode("hello") == load_model(
        str(tiny_model_dir), tmp_path / "cache", "cpu", "float32"
    ).tokenizer.encode("hello")


def test_random_model_without_a_config_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _random_model()
    monkeypatch.setattr(sys, "argv", ["random_model.py", "--like", str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.json" in err
