"""The trained model as files anyone can load: safetensors weights and a JSON manifest, in a
local directory or a URI ``pyarrow.fs`` opens. The files and the manifest's fields:
docs/spec.md ("The trained model: artifacts"). :func:`load_model` rebuilds the
``torch.nn.Module`` from them without Ray or the service.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from dynabatch.actors.data.fs import join

MANIFEST = "manifest.json"
FINAL = "model.safetensors"
BEST = "best.safetensors"
FILES = {"final": FINAL, "best": BEST}
# The job's tokenizer (dataset.tokenizer), kept beside the weights when the spec names one.
TOKENIZER = "tokenizer.json"
FORMAT = "dynabatch-model/1"
# What an export may be written as: the model directory above, or a Hugging Face folder
# that transformers' from_pretrained loads (hf_files).
EXPORT_FORMATS = ("dynabatch", "hf")


class ExportError(ValueError):
    """A model directory or manifest that cannot be written or read; the one-line message
    names the file (and the field) at fault."""


def dynabatch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dynabatch")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def _file_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict as safetensors takes it: contiguous CPU tensors, none sharing memory
    (tied weights are stored twice; ``load_state_dict`` ties them again)."""
    import torch

    out, seen = {}, set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ExportError(
                f"model state {key!r}: a {type(value).__name__}, not a tensor "
                "(safetensors holds tensors only)"
            )
        t = value.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[key] = t
    return out


def model_files(
    *,
    spec: Any,
    input_shape: tuple[int, ...] | list[int],
    num_classes: int,
    final: Mapping[str, Any],
    epoch: int,
    metrics: Mapping[str, float] | None = None,
    best: Mapping[str, Any] | None = None,
    best_epoch: int | None = None,
    best_metrics: Mapping[str, float] | None = None,
    job_id: str | None = None,
) -> dict[str, bytes]:
    """The model directory's files by name (bytes): the weights (``final``: a model state
    dict; ``best`` when kept) and the manifest describing them. ``spec``: the job's
    :class:`~dynabatch.actors.spec.JobSpec`."""
    from safetensors.torch import save

    files: dict[str, bytes] = {}
    weights: dict[str, Any] = {}
    for which, state, ep, scores in (
        ("final", final, epoch, metrics),
        ("best", best, best_epoch, best_metrics),
    ):
        if state is None:
            continue
        tensors = _file_tensors(state)
        files[FILES[which]] = save(tensors, metadata={"format": "pt"})
        weights[which] = {
            "file": FILES[which],
            "epoch": ep,
            "metrics": {k: float(v) for k, v in (scores or {}).items()},
            "dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()},
        }
    model = spec.model
    manifest = {
        "format": FORMAT,
        "dynabatch_version": dynabatch_version(),
        "job_id": job_id,
        "model": {"name": model.name, "hidden": model.hidden, "options": dict(model.options)},
        "input_shape": [int(n) for n in input_shape],
        "input": input_description(spec, input_shape),
        "num_classes": int(num_classes),
        "weights": weights,
        "spec": spec.model_dump(mode="json"),
    }
    if model.name == "hf":
        # What rebuilds it with transformers alone: no pretrained folder, no user module.
        from dynabatch.actors.workloads import WorkloadError
        from dynabatch.actors.workloads.hf import hf_model_config

        try:
            manifest["hf_config"], manifest["hf_class"] = hf_model_config(
                model, tuple(input_shape), num_classes)
        except WorkloadError as err:
            raise ExportError(str(err)) from None
    if spec.dataset.tokenizer:
        try:
            with open(spec.dataset.tokenizer, "rb") as f:
                files[TOKENIZER] = f.read()
        except OSError as err:
            raise ExportError(f"dataset.tokenizer: cannot read {spec.dataset.tokenizer} "
                              f"({err.strerror})") from None
        manifest["tokenizer"] = TOKENIZER
    files[MANIFEST] = json.dumps(manifest, indent=2, sort_keys=True).encode()
    return files


def input_description(spec: Any, input_shape: tuple[int, ...] | list[int]) -> dict[str, Any]:
    """What the model takes, in words a user can act on: for a text model token ids
    (``input_ids``, int64, ``seq_len`` tokens a sample), else a float tensor of
    ``shape`` a sample."""
    if spec.model.name == "hf" or spec.loss == "next_token":
        return {"kind": "token_ids", "key": "input_ids", "dtype": "int64",
                "seq_len": int(input_shape[0]) if len(input_shape) == 1 else None,
                "tokenizer": TOKENIZER if spec.dataset.tokenizer else None}
    return {"kind": "tensor", "dtype": "float32", "shape": [int(n) for n in input_shape]}


# ------------------------------------------------------------------------------ the files

def write_files(files: Mapping[str, bytes], directory: str, field: str = "artifacts.dir") -> str:
    """Write ``files`` into ``directory`` (created), the manifest last: a reader that finds
    the manifest finds the weights it names. Returns the directory as the filesystem names
    it. :class:`ExportError` naming ``field`` when it cannot be written."""
    from dynabatch.actors.data.fs import open_fs
    from dynabatch.actors.errors import first_line

    filesystem, path = open_fs(directory, field)
    try:
        filesystem.create_dir(path, recursive=True)
        for name in sorted(files, key=lambda n: n == MANIFEST):
            with filesystem.open_output_stream(join(path, name)) as out:
                out.write(files[name])
    except (OSError, ValueError) as err:
        raise ExportError(f"{field}: cannot write {directory} ({first_line(err)})") from err
    return path


def _read(filesystem: Any, path: str, shown: str) -> bytes:
    from dynabatch.actors.errors import first_line

    try:
        with filesystem.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        raise ExportError(f"{shown}: no such file") from None
    except (OSError, ValueError) as err:
        raise ExportError(f"{shown}: cannot read it ({first_line(err)})") from err


def has_model(directory: str) -> bool:
    """Whether ``directory`` holds a model (its manifest)."""
    from dynabatch.actors.data.fs import kind_of, open_fs

    try:
        filesystem, path = open_fs(directory, "artifacts.dir")
        return kind_of(filesystem, join(path, MANIFEST)) == "file"
    except (OSError, ValueError):
        return False


def read_files(directory: str) -> dict[str, bytes]:
    """The model directory's files by name: the manifest (checked) and the weights it
    names. :class:`ExportError` naming the file when one is missing or wrong."""
    from dynabatch.actors.data.fs import open_fs

    filesystem, path = open_fs(directory, "model directory")
    raw = _read(filesystem, join(path, MANIFEST), join(directory, MANIFEST))
    manifest = parse_manifest(raw, join(directory, MANIFEST))
    files = {MANIFEST: raw}
    if manifest.get("tokenizer") == TOKENIZER:
        files[TOKENIZER] = _read(filesystem, join(path, TOKENIZER), join(directory, TOKENIZER))
    for entry in manifest["weights"].values():
        files[entry["file"]] = _read(
            filesystem, join(path, entry["file"]), join(directory, entry["file"])
        )
    return files


def parse_manifest(raw: bytes, shown: str = MANIFEST) -> dict[str, Any]:
    """The manifest in ``raw``, checked: :class:`ExportError` with one line naming the file
    (``shown``) and the field when it is not one of ours."""
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"{shown}: not JSON ({err})") from None
    if not isinstance(m, dict):
        raise ExportError(f"{shown}: not a dynabatch model manifest (a {type(m).__name__})")
    if m.get("format") != FORMAT:
        raise ExportError(f"{shown}: format: expected {FORMAT!r}, got {m.get('format')!r}")
    model = m.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        raise ExportError(f"{shown}: model: must be an object with a name")
    shape = m.get("input_shape")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise ExportError(
            f"{shown}: input_shape: must be a list of positive integers, got {shape!r}"
        )
    n = m.get("num_classes")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ExportError(f"{shown}: num_classes: must be a positive integer, got {n!r}")
    weights = m.get("weights")
    if not isinstance(weights, dict) or "final" not in weights:
        raise ExportError(f"{shown}: weights: must name the final weights (weights.final)")
    for which, entry in weights.items():
        if which not in FILES:
            raise ExportError(f"{shown}: weights.{which}: unknown (expected final or best)")
        if not isinstance(entry, dict) or entry.get("file") != FILES[which]:
            raise ExportError(f"{shown}: weights.{which}.file: expected {FILES[which]!r}")
    return m


def load_model(directory: str | os.PathLike[str], which: str = "final", device: str = "cpu"
               ) -> Any:
    """The trained ``torch.nn.Module`` in ``directory`` (a job's model directory, as
    ``dynabatch export`` writes it), in eval mode: built by the manifest's builder (a
    built-in, or the user's ``pkg.mod:fn``, which must be importable here) with its options,
    input shape and class count, then loaded with the ``which`` weights (``final`` or
    ``best``). No Ray. :class:`ExportError` with one line naming the file and field."""
    from dynabatch.actors.spec import ModelSpec
    from dynabatch.actors.workloads import WorkloadError
    from dynabatch.actors.workloads.models import build_model
    from pydantic import ValidationError
    from safetensors.torch import load

    directory = os.fspath(directory)  # a pathlib.Path is the usual thing to hand over
    files = read_files(directory)
    shown = join(directory, MANIFEST)
    manifest = parse_manifest(files[MANIFEST], shown)
    if which not in manifest["weights"]:
        raise ExportError(
            f"{shown}: weights.{which}: this model has no {which} weights "
            f"(it has {', '.join(sorted(manifest['weights']))})"
        )
    try:
        spec = ModelSpec.model_validate(manifest["model"])
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise ExportError(f"{shown}: model.{where}: {e['msg']}") from None
    try:
        if isinstance(manifest.get("hf_config"), dict):
            model = _hf_model(manifest, shown)
        else:
            model = build_model(spec, tuple(manifest["input_shape"]), manifest["num_classes"])
    except WorkloadError as err:
        raise ExportError(f"{shown}: {err}") from None
    name = manifest["weights"][which]["file"]
    try:
        state = load(files[name])
    except Exception as err:  # safetensors raises its own error types for a bad file
        raise ExportError(
            f"{join(directory, name)}: not a safetensors file ({' '.join(str(err).split())})"
        ) from None
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = " ".join(str(err).split())[:300]
        raise ExportError(
            f"{join(directory, name)}: does not fit the model {spec.name!r} ({first})"
        ) from None
    return model.to(device).eval()


def _hf_model(manifest: dict[str, Any], shown: str) -> Any:
    """The transformers model a manifest's ``hf_config`` and ``hf_class`` describe, with
    fresh weights: transformers alone rebuilds it (no user module, no pretrained folder)."""
    try:
        import transformers
    except ImportError as err:
        raise ExportError(f"{shown}: hf_config: needs the transformers package ({err})") from None
    config = dict(manifest["hf_config"])
    cls = getattr(transformers, str(manifest.get("hf_class")), None)
    if not isinstance(cls, type):
        raise ExportError(f"{shown}: hf_class: {manifest.get('hf_class')!r} is not a "
                          f"transformers model class (transformers {transformers.__version__})")
    try:
        cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        return cls(cfg)
    except Exception as err:
        raise ExportError(f"{shown}: hf_config: transformers cannot build it "
                          f"({type(err).__name__}: {' '.join(str(err).split())[:300]})") from None


def hf_files(files: Mapping[str, bytes], which: str = "final") -> dict[str, bytes]:
    """A dynabatch model directory's files (``files``, as :func:`read_files` gives them) as a
    Hugging Face folder's: ``config.json`` (with ``id2label``/``label2id`` when the spec
    names its ``dataset.labels``), ``model.safetensors`` (the ``which`` weights) and, when
    the job had a ``dataset.tokenizer``, ``tokenizer.json`` with a ``tokenizer_config.json``
    that makes ``AutoTokenizer`` read it. ``AutoModelFor<task>.from_pretrained(folder)``
    loads it. :class:`ExportError` for a model that is not a transformers model."""
    import tempfile
    from pathlib import Path

    manifest = parse_manifest(files[MANIFEST])
    if manifest["model"]["name"] != "hf" or not isinstance(manifest.get("hf_config"), dict):
        raise ExportError(f"{MANIFEST}: model.name: {manifest['model']['name']!r} is not a "
                          "Hugging Face model (model.name: hf): export it as dynabatch")
    with tempfile.TemporaryDirectory(prefix="dynabatch-hf-") as tmp:
        src = Path(tmp) / "model"
        src.mkdir()
        for name, data in files.items():
            (src / name).write_bytes(data)
        model = load_model(src, which)
        labels = (manifest.get("spec") or {}).get("dataset", {}).get("labels")
        if labels and len(labels) == model.config.num_labels:
            model.config.id2label = dict(enumerate(labels))
            model.config.label2id = {name: i for i, name in enumerate(labels)}
        out = Path(tmp) / "hf"
        model.save_pretrained(out, safe_serialization=True)
        result = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
    if TOKENIZER in files:
        result[TOKENIZER] = files[TOKENIZER]
        result["tokenizer_config.json"] = json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast",
             "model_max_length": int(manifest["input_shape"][0])}, indent=2).encode()
    return result
