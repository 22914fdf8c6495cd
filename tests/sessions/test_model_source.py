"""What `--model` can name: the bundled GGUF by its path, a folder, a hub id (here only while the hub
cannot be reached: these tests run offline), and the typed errors for what names nothing."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from sessions.errors import ModelNotFound, ModelUnavailable
from sessions.model_hub import hub_unreachable_reason
from sessions.model_source import BUNDLED_NAME, bundled_gguf_path, load_model, resolve_model
from tests.conftest import MODEL_CACHE

HUB_ID = "HuggingFaceTB/SmolLM2-360M-Instruct"


@pytest.mark.real_model
def test_the_bundled_gguf_by_path_loads_the_converted_copy(smollm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    gguf = bundled_gguf_path()
    with caplog.at_level(logging.INFO, logger="sessions"):
        loaded = load_model(str(gguf), MODEL_CACHE, "cpu", "float32")
    assert (loaded.name, loaded.path) == ("SmolLM2-135M-Instruct.Q4_1", smollm_dir)
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    assert resolve_model("default", MODEL_CACHE).location == str(smollm_dir)
    assert resolve_model("default", MODEL_CACHE).name == BUNDLED_NAME


def test_a_folder_and_a_hub_id_are_told_apart(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir), MODEL_CACHE).location == str(tiny_model_dir)
    assert not resolve_model(str(tiny_model_dir), MODEL_CACHE).hub
    hub = resolve_model(HUB_ID, MODEL_CACHE)
    assert (hub.name, hub.location, hub.hub) == ("SmolLM2-360M-Instruct", HUB_ID, True)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing.gguf", r"^no such GGUF file: .*missing\.gguf$"),
        ("empty-folder", r"^not a Hugging Face model directory \(no config\.json\): "),
        ("no/such/place", r"and not a Hugging Face hub id \(owner/name\): 'no/such/place'$"),
    ],
)
def test_a_model_that_names_nothing_is_model_not_found(tmp_path: Path, name: str, message: str) -> None:
    (tmp_path / "empty-folder").mkdir()
    model = str(tmp_path / name) if name != "no/such/place" else name
    with pytest.raises(ModelNotFound, match=message):
        resolve_model(model, MODEL_CACHE)


def test_a_hub_id_offline_is_a_one_line_error_saying_the_hub_cannot_be_reached() -> None:
    # conftest sets HF_HUB_OFFLINE=1 before transformers is imported: no network is tried.
    with pytest.raises(ModelNotFound) as raised:
        load_model(HUB_ID, MODEL_CACHE, "cpu", "float32")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"cannot download {HUB_ID}: the Hugging Face hub is not reachable (HF_HUB_OFFLINE")
    assert message.endswith("point --model (CHATKV_MODEL) at a local model folder or a .gguf file instead")


def test_an_endpoint_that_refuses_connections_is_reported_at_once() -> None:
    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        reason = hub_unreachable_reason(f"http://127.0.0.1:{port}", timeout_s=5)
    assert reason is not None and reason.startswith(f"127.0.0.1:{port}: ")


def test_a_gguf_file_that_is_no_gguf_is_model_not_found_and_leaves_no_copy(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a gguf file at all")
    cache = tmp_path / "models"
    with pytest.raises(ModelNotFound, match=r"^cannot convert .*notes\.gguf: .*not a GGUF file"):
        load_model(str(bad), cache, "cpu", "float32")
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.real_model
def test_a_truncated_gguf_and_a_config_that_is_no_object_are_typed_errors(tmp_path: Path) -> None:
    truncated = tmp_path / "cut.gguf"
    with bundled_gguf_path().open("rb") as whole:
        truncated.write_bytes(whole.read(1_000_000))  # the header, and the tensors cut off
    with pytest.raises(ModelNotFound, match=r"^cannot convert .*cut\.gguf"):
        load_model(str(truncated), tmp_path / "models", "cpu", "float32")
    folder = tmp_path / "odd-model"
    folder.mkdir()
    (folder / "config.json").write_text("[]")
    with pytest.raises(ModelUnavailable, match=r"^cannot load the model in .*odd-model"):
        load_model(str(folder), tmp_path / "models", "cpu", "float32")
