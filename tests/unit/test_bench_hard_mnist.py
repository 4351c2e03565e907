"""The generated benchmark data of issue 21 (bench/hard_mnist.py): a benchmark-only
workload, loaded by import path as any user dataset."""

import numpy as np
import pytest

pytest.importorskip("torch")


def test_hard_mnist_has_rare_classes_label_noise_and_is_deterministic():
    from bench.hard_mnist import load

    a = load(n_train=2000, n_test=500, seed=3, noise_per_mille=0)
    b = load(n_train=2000, n_test=500, seed=3, noise_per_mille=0)
    assert a.x_train.shape == (2000, 1, 28, 28) and a.x_test.shape == (500, 1, 28, 28)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_train, b.y_train)
    counts = np.bincount(a.y_train, minlength=10)
    assert counts[5] == counts[9] == 40  # 2% each: sampling bias
    assert np.bincount(a.y_test, minlength=10).min() == 50  # a balanced test set
    noisy = load(n_train=2000, n_test=500, seed=3, noise_per_mille=100)
    flipped = (noisy.y_train != a.y_train).mean()
    assert 0.06 < flipped < 0.14  # the same images, a fixed subset relabelled
    assert np.array_equal(noisy.x_train, a.x_train)


def test_cifar_like_is_cifar_format_and_standardised():
    from bench.hard_mnist import cifar_like

    d = cifar_like(n_train=600, n_test=200, seed=1)
    assert d.x_train.shape == (600, 3, 32, 32) and d.num_classes == 10
    assert abs(float(d.x_train.mean())) < 1e-3
    assert np.allclose(d.x_train.std(axis=(0, 2, 3)), 1.0, atol=1e-3)


def test_they_load_as_user_datasets_in_a_spec():
    from dynabatch.actors.spec import JobSpec
    from dynabatch.actors.workloads.datasets import load_dataset

    spec = JobSpec.model_validate({"dataset": {
        "name": "bench.hard_mnist:load", "shuffle": "once",
        "options": {"n_train": 300, "n_test": 100, "seed": 0}}})
    ds = load_dataset(spec.dataset)
    assert len(ds.y_train) == 300 and ds.num_classes == 10
