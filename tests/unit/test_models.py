"""Models: shapes, determinism, options and user builders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dynabatch.actors.spec import DatasetSpec, ModelSpec
from dynabatch.actors.workloads import WorkloadError
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.actors.workloads.models import LeNet, ResNet, build_model
from torch import nn

PLUGINS = "tests.unit.workload_plugins"

SHAPES = {
    "mlp": [(64,), (32,), (1, 28, 28), (3, 32, 32), (1, 8, 8)],
    "lenet": [(1, 28, 28), (3, 32, 32), (1, 8, 8), (64,), (28, 28), (3, 64, 48)],
    "resnet": [(1, 28, 28), (3, 32, 32), (1, 8, 8), (64,)],
}
CASES = [(name, shape) for name, shapes in SHAPES.items() for shape in shapes]


@pytest.mark.parametrize(
    ("name", "shape"), CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES]
)
def test_forward_shape(name: str, shape: tuple[int, ...]) -> None:
    model = build_model(ModelSpec(name=name, hidden=16), shape, 7)
    out = model(torch.randn(3, *shape))
    assert out.shape == (3, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["mlp", "lenet", "resnet"])
def test_construction_is_deterministic_under_manual_seed(name: str) -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(ModelSpec(name=name), (1, 28, 28), 10).state_dict()

    a, b, c = weights(0), weights(0), weights(1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].dtype.is_floating_point)


def test_mlp_width_and_layers() -> None:
    model = build_model(ModelSpec(name="mlp", hidden=24), (1, 8, 8), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 24), (24, 24), (24, 10)]
    deeper = build_model(ModelSpec(name="mlp", hidden=8, options={"layers": 3}), (5,), 2)
    assert sum(isinstance(m, nn.Linear) for m in deeper.modules()) == 4


def test_lenet_is_lenet5() -> None:
    model = build_model(ModelSpec(name="lenet"), (1, 28, 28), 10)
    assert isinstance(model, LeNet)
    convs = [
        (m.in_channels, m.out_channels, m.kernel_size)
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    assert convs == [(1, 6, (5, 5)), (6, 16, (5, 5))]
    fcs = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    assert fcs == [(400, 120), (120, 84), (84, 10)]
    # The classic CIFAR variant: no padding on 32x32 still gives a 16x5x5 map.
    cifar = build_model(ModelSpec(name="lenet"), (3, 32, 32), 10)
    assert next(m for m in cifar.modules() if isinstance(m, nn.Linear)).in_features == 400


def test_lenet_rejects_non_image_input() -> None:
    with pytest.raises(
        WorkloadError, match=r"^model.name: lenet needs image input .* got input shape \(32,\)"
    ):
        build_model(ModelSpec(name="lenet"), (32,), 4)


def test_resnet_options_and_norms() -> None:
    spec = ModelSpec(name="resnet", options={"widths": [8, 16], "blocks": [2, 1]})
    model = build_model(spec, (3, 32, 32), 10)
    assert isinstance(model, ResNet)
    assert model.head[-1].in_features == 16
    # GroupNorm by default: no buffers to keep in sync across data-parallel replicas.
    assert list(model.buffers()) == []
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    bn = build_model(
        ModelSpec(name="resnet", options={"norm": "batch", "widths": [8]}), (1, 8, 8), 3
    )
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn.modules())
    plain = build_model(
        ModelSpec(name="resnet", options={"norm": "none", "widths": [8]}), (1, 8, 8), 3
    )
    assert not any(isinstance(m, nn.GroupNorm | nn.BatchNorm2d) for m in plain.modules())
    assert plain(torch.randn(2, 1, 8, 8)).shape == (2, 3)


def test_models_train_on_a_single_sample_batch() -> None:
    # Dynamic batching can give a slow worker one sample; default models must cope.
    for name in ("mlp", "lenet", "resnet"):
        model = build_model(ModelSpec(name=name), (1, 28, 28), 10).train()
        loss = nn.functional.cross_entropy(model(torch.randn(1, 1, 28, 28)), torch.tensor([3]))
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            ModelSpec(name="mlp", options={"depth": 3}),
            r"model.options: unknown option 'depth' for mlp \(allowed: layers\)",
        ),
        (
            ModelSpec(name="mlp", options={"layers": 0}),
            "model.options.layers: must be an integer from 1",
        ),
        (
            ModelSpec(name="lenet", options={"width": 3}),
            r"unknown option 'width' for lenet \(allowed: none\)",
        ),
        (
            ModelSpec(name="resnet", options={"widths": []}),
            "model.options.widths: must be a list of 1 to 8",
        ),
        (
            ModelSpec(name="resnet", options={"widths": [8, "x"]}),
            "model.options.widths: must be an integer",
        ),
        (
            ModelSpec(name="resnet", options={"blocks": [1, 1]}),
            "model.options.blocks: needs 3 entries",
        ),
        (
            ModelSpec(name="resnet", options={"norm": "layer"}),
            "model.options.norm: must be one of group, batch, none",
        ),
    ],
)
def test_bad_model_options(spec: ModelSpec, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        build_model(spec, (1, 28, 28), 10)


def test_input_shape_validation() -> None:
    assert build_model(ModelSpec(), torch.Size([1, 8, 8]), 3)(torch.zeros(2, 1, 8, 8)).shape == (
        2,
        3,
    )
    assert build_model(ModelSpec(), np.zeros((5, 4)).shape[1:], 3)(torch.zeros(2, 4)).shape == (
        2,
        3,
    )
    for bad in [(), (0, 3), (2.0, 3)]:
        with pytest.raises(WorkloadError, match="model: input_shape must be positive integers"):
            build_model(ModelSpec(), bad, 3)  # type: ignore[arg-type]
    with pytest.raises(WorkloadError, match="model: num_classes"):
        build_model(ModelSpec(), (4,), 0)


def test_user_model() -> None:
    model = build_model(ModelSpec(name=f"{PLUGINS}:tiny_net", options={"width": 5}), (2, 3), 4)
    assert model(torch.zeros(6, 2, 3)).shape == (6, 4)
    assert model[1].out_features == 5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            ModelSpec(name="tests.unit.nope:build"),
            "model.name: cannot import module 'tests.unit.nope' "
            "(No module named 'tests.unit.nope')",
        ),
        (
            ModelSpec(name=f"{PLUGINS}:missing"),
            f"model.name: module '{PLUGINS}' has no attribute 'missing'",
        ),
        (ModelSpec(name=f"{PLUGINS}:NOT_CALLABLE"), "is not callable (it is a int)"),
        (
            ModelSpec(name=f"{PLUGINS}:not_a_module"),
            f"model.name: '{PLUGINS}:not_a_module' returned a str, not a torch.nn.Module",
        ),
        (ModelSpec(name=f"{PLUGINS}:failing_net"), "raised ValueError: unsupported input"),
        (
            ModelSpec(name=f"{PLUGINS}:tiny_net", options={"depth": 2}),
            f"model.options: unknown option 'depth' for '{PLUGINS}:tiny_net' (it takes: "
            "width)",
        ),
        (
            ModelSpec(name=f"{PLUGINS}:tiny_net", options={"num_classes": 2}),
            "model.options: 'num_classes' is passed by the service",
        ),
    ],
)
def test_user_model_errors(spec: ModelSpec, message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        build_model(spec, (4,), 3)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_mlp_learns_digits() -> None:
    # The two halves of the interface fit together: a few epochs on digits beat chance by far.
    data = load_dataset(DatasetSpec(name="digits"), seed=0)
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="mlp", hidden=32), data.input_shape, data.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    for _ in range(5):
        for i in range(0, len(x), 64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i : i + 64]), y[i : i + 64]).backward()
            opt.step()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x_test)).argmax(dim=1).numpy()
    assert (pred == data.y_test).mean() > 0.8
