"""Pretrained weights from a local folder (``model.options.pretrained: DIR``), the manifest
that rebuilds an hf model with transformers alone, and the Hugging Face export (``hf_files``:
a folder ``from_pretrained`` loads, with id2label and the job's tokenizer). Nothing is
downloaded: the tiny pretrained folder and tokenizer are made here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dynabatch.actors.export import hf_files, load_model, model_files, read_files, write_files
from dynabatch.actors.spec import SpecError, parse_spec
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.models import build_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

BERT = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16)


def tiny_pretrained(folder: Path) -> Path:
    """A save_pretrained folder of a 1-layer BERT (masked LM, as a pretrained model is)."""
    torch.manual_seed(1)
    transformers.BertForMaskedLM(transformers.BertConfig(**BERT)).save_pretrained(folder)
    return folder


def tiny_tokenizer(path: Path, size: int = 40) -> Path:
    """A word-level tokenizers tokenizer.json of ``size`` words."""
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i for i in range(2, size)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def _spec(pre: Path, tokenizer: Path | None = None, **dataset):
    return parse_spec({
        "dataset": {"name": "synthetic", "labels": ["neg", "pos"], **dataset,
                    **({"tokenizer": str(tokenizer)} if tokenizer else {})},
        "model": {"name": "hf", "options": {"pretrained": str(pre),
                                            "task": "sequence-classification"}},
    })


def test_pretrained_weights_load_from_a_save_pretrained_folder(tmp_path):
    pre = tiny_pretrained(tmp_path / "pre")
    model = build_model(_spec(pre).model, (8,), 2)
    assert type(model).__name__ == "BertForSequenceClassification"
    saved = transformers.BertForMaskedLM.from_pretrained(pre).state_dict()
    w = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(model.state_dict()[w], saved[w])  # the folder's weights, not fresh
    assert model.config.num_labels == 2 and model.config.use_cache is False
    with pytest.raises(WorkloadError, match=r"model.options.pretrained \(its config's "
                       r"vocab_size\): token id 45 in the batch's input_ids"):
        model(torch.tensor([[3, 45]]))


@pytest.mark.parametrize(("pretrained", "says"), [
    ("bert-base-uncased", "model.options.pretrained: hub id 'bert-base-uncased': nothing is "
                          "downloaded"),
    ("rel/dir", "model.options.pretrained: hub id 'rel/dir'"),
])
def test_a_pretrained_that_is_not_an_absolute_folder_is_refused_naming_the_field(
        pretrained, says):
    with pytest.raises(SpecError) as err:
        parse_spec({"model": {"name": "hf", "options": {"pretrained": pretrained}}})
    assert any(p.startswith(says) for p in err.value.problems), err.value.problems


def test_a_pretrained_folder_without_a_model_is_named(tmp_path):
    with pytest.raises(WorkloadError, match=r"model.options.pretrained: .* holds neither "
                       r"config.json"):
        build_model(_spec(tmp_path).model, (8,), 2)


def test_the_pretrained_folder_is_confined_like_dataset_paths(tmp_path):
    from dynabatch.service.submit_policy import check_paths

    spec = _spec(tmp_path / "pre", tokenizer=tmp_path / "t.json")
    fields = {f for f, _ in check_paths(spec, ["/srv/data"], None)}
    assert fields == {"model.options.pretrained", "dataset.tokenizer"}
    assert check_paths(spec, [str(tmp_path)], None) == []


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line_naming_the_field(tmp_path):
    from dynabatch.actors.workloads.hf import check_tokenizer

    pre = tiny_pretrained(tmp_path / "pre")
    check_tokenizer(_spec(pre, tiny_tokenizer(tmp_path / "ok.json", 40)))
    with pytest.raises(WorkloadError) as err:
        check_tokenizer(_spec(pre, tiny_tokenizer(tmp_path / "big.json", 50)))
    assert str(err.value) == (
        f"dataset.tokenizer: {tmp_path}/big.json has 50 tokens, more than the model's "
        "vocab_size 40 (model.options.pretrained's config.json)")


def test_the_hf_export_loads_with_transformers_alone_in_a_fresh_process(tmp_path):
    pre = tiny_pretrained(tmp_path / "pre")
    tok = tiny_tokenizer(tmp_path / "tokenizer.json")
    spec = _spec(pre, tok)
    torch.manual_seed(0)
    trained = build_model(spec.model, (8,), 2)
    files = model_files(spec=spec, input_shape=(8,), num_classes=2,
                        final=trained.state_dict(), epoch=1)
    manifest = json.loads(files["manifest.json"])
    assert manifest["input"] == {"kind": "token_ids", "key": "input_ids", "dtype": "int64",
                                 "seq_len": 8, "tokenizer": "tokenizer.json"}
    assert manifest["hf_class"] == "BertForSequenceClassification"
    write_files(files, str(tmp_path / "job"))
    shutil.rmtree(pre)  # load_model needs neither the pretrained folder nor a user module
    x = torch.tensor([[2, 5, 7, 9, 3, 1, 1, 1]])
    again = load_model(tmp_path / "job")
    with torch.no_grad():
        want = trained.eval()(x).logits
        assert torch.allclose(again(x).logits, want)
    out = tmp_path / "hf"
    out.mkdir()
    for name, data in hf_files(read_files(str(tmp_path / "job"))).items():
        (out / name).write_bytes(data)
    code = (
        "import json, sys, torch, transformers as t\n"
        "m = t.AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).eval()\n"
        "tok = t.AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "ids = tok('w2 w5 w7', return_tensors='pt')['input_ids']\n"
        "print(json.dumps([m.config.id2label[1], ids.tolist(), "
        "m(torch.tensor([[2, 5, 7, 9, 3, 1, 1, 1]])).logits.tolist()]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    label, ids, logits = json.loads(run.stdout.strip().splitlines()[-1])
    assert label == "pos" and ids == [[2, 5, 7]]
    assert torch.allclose(torch.tensor(logits), want, atol=1e-5)


def test_the_cli_and_rest_download_becomes_an_hf_folder_and_a_non_hf_model_is_refused(
        tmp_path):
    """What ``dynabatch export ID --format hf`` does with the zip the service serves."""
    from dynabatch.actors.export import ExportError
    from dynabatch.service.artifacts import write_hf_export, zip_model

    pre = tiny_pretrained(tmp_path / "pre")
    spec = _spec(pre, tiny_tokenizer(tmp_path / "tokenizer.json"))
    model = build_model(spec.model, (8,), 2)
    files = model_files(spec=spec, input_shape=(8,), num_classes=2, final=model.state_dict(),
                        epoch=0)
    names = write_hf_export(zip_model(files), tmp_path / "out")
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(names)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["label2id"]["pos"] == 1
    mlp = parse_spec({})
    plain = model_files(spec=mlp, input_shape=(64,), num_classes=10, epoch=0,
                        final=build_model(mlp.model, (64,), 10).state_dict())
    with pytest.raises(ExportError, match="'mlp' is not a Hugging Face model"):
        write_hf_export(zip_model(plain), tmp_path / "no")


def test_dynabatch_run_refuses_a_tokenizer_larger_than_the_model_before_ray_starts(
        tmp_path, monkeypatch):
    """The pre-check of ``dynabatch run`` reads ``dataset.tokenizer``: one line, exit 2, and
    Ray never starts (it would only fail the job later, after minutes of start-up)."""
    import dynabatch.service.raycluster
    import ray
    import typer
    from dynabatch.api.cli import run as run_cli
    from typer.testing import CliRunner

    def no_ray(*_, **__):
        raise AssertionError("Ray was started before the tokenizer was checked")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(dynabatch.service.raycluster, "connect", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    pre = tiny_pretrained(tmp_path / "pre")
    big = tiny_tokenizer(tmp_path / "big.json", 50)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        "name: t\nworkers: 1\nglobal_batch: 8\nepochs: 1\n"
        f"dataset: {{name: parquet, path: {tmp_path}/data, tokenizer: {big}}}\n"
        f"model: {{name: hf, options: {{pretrained: {pre}, task: sequence-classification}}}}\n")
    app = typer.Typer(pretty_exceptions_enable=False)
    run_cli.register(app)
    result = CliRunner().invoke(app, ["run", str(cfg)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.stderr.splitlines() == [
        f"error: {cfg}: dataset.tokenizer: {big} has 50 tokens, more than the model's "
        "vocab_size 40 (model.options.pretrained's config.json)"]


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf-text"


def _example_spec(data: Path, **update):
    """examples/hf-text/bert-sentiment.yaml on the inputs its make_bert.py wrote in
    ``data`` (the spec names /tmp/dynabatch-hf-bert)."""
    import warnings

    from dynabatch.actors.spec import SpecWarning, load_spec

    with warnings.catch_warnings():
        warnings.simplefilter("error", SpecWarning)  # the example is warning-free
        spec = load_spec(EXAMPLE / "bert-sentiment.yaml")
    named = spec.model_dump(mode="json")
    assert named["dataset"]["path"] == "/tmp/dynabatch-hf-bert"
    named["dataset"].update(path=str(data), tokenizer=str(data / "tokenizer.json"))
    named["model"]["options"]["pretrained"] = str(data / "pretrained")
    named.update(update)
    return parse_spec(named)


def test_the_bert_example_trains_and_its_hf_export_loads_in_a_fresh_process(tmp_path):
    """examples/hf-text/README.md's path without Ray: make_bert.py's inputs, the example's
    spec submitted to the service (the fake cluster trains its real model), the trained
    model downloaded as an HF folder with the Python API (``Job.model(DIR, format="hf")``,
    what ``dynabatch export ID --format hf`` writes) and classify.py loading it with
    transformers alone in a fresh process."""
    from dynabatch import Client
    from dynabatch.api.app import create_app
    from dynabatch.scheduler.core.lifecycle import JobState
    from dynabatch.service.settings import Settings
    from fastapi.testclient import TestClient

    from tests.asgi import AppTransport
    from tests.fakes import FakeCluster

    data = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLE / "make_bert.py"), str(data), "--train",
                    "64", "--test", "32"], check=True, capture_output=True, timeout=300)
    spec = _example_spec(data, epochs=2)
    cluster = FakeCluster(real_gradients=True)
    settings = Settings(db_path=str(tmp_path / "jobs.db"), sync_interval_s=0,
                        data_roots=str(data))
    with TestClient(create_app(settings, cluster=cluster)) as http:
        client = Client(transport=AppTransport(http))
        job = client.submit(spec)
        coordinator = cluster.coordinators[job.id]
        while not coordinator.state.is_terminal:  # each advance: one step of its driver
            cluster.advance(job.id)
        assert coordinator.state == JobState.SUCCEEDED, coordinator.reason
        # Macro-F1 on the validation split (a quarter of the 64 training reviews) every
        # epoch, and the final test score over the whole test set (32 reviews) once.
        history = coordinator.history()
        assert all(0.0 <= r.validation_metrics["f1"] <= 1.0 for r in history)
        assert [bool(r.test_metrics) for r in history] == [False, True]
        last = history[-1]
        assert 0.0 <= last.test_metrics["f1"] <= 1.0
        assert sum(map(sum, last.validation_matrices["confusion_matrix"])) == 16
        cm = last.test_matrices["confusion_matrix"]
        assert len(cm) == 2 and sum(map(sum, cm)) == 32
        assert coordinator.snapshot().validation_metrics == last.validation_metrics
        out = job.model(tmp_path / "hf", format="hf")
        with pytest.raises(ValueError, match=r"^format: must be dynabatch or hf, got 'onnx'"):
            job.model(tmp_path / "x", format="onnx")
    assert sorted(p.name for p in Path(out).iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    words = ["the", "film", "was", "really", "great", "and", "fun"]
    run = subprocess.run([sys.executable, str(EXAMPLE / "classify.py"), out, " ".join(words)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["labels"] == {"0": "negative", "1": "positive"}
    (review,) = said["reviews"]
    vocab = json.loads((data / "tokenizer.json").read_text())["model"]["vocab"]
    assert review["ids"] == [vocab[w] for w in words]  # the job's tokenizer
    assert review["label"] in ("negative", "positive")


def test_token_ids_that_arrive_as_floats_are_cast_and_a_fraction_is_named(tmp_path):
    """A Parquet integer column read for class targets reaches the model as float32: the
    ids are whole numbers, so the model takes them as int64 (not torch's 'Expected tensor
    for argument #1 indices to have ... Long'); a fraction is no token id."""
    from dynabatch.actors.workloads.hf import TokenIdError

    model = build_model(_spec(tiny_pretrained(tmp_path / "pre")).model, (4,), 2).eval()
    ids = torch.tensor([[2, 5, 7, 39]])
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(model(ids.float()).logits, want)
        assert torch.equal(model(input_ids=ids.float()).logits, want)
    with pytest.raises(TokenIdError, match=r"^input_ids: the batch holds 2.5, not a token id"):
        model(torch.tensor([[2.5, 3.0]]))
    with pytest.raises(TokenIdError, match="token id 45 in the batch's input_ids"):
        model(torch.tensor([[45.0]]))
