"""Models, datasets and optimizers by name: built-ins, torchvision, user registration, import paths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.config.schema import OptimConfig, SchedConfig
from ddpkit.data.datasets import fashion_mnist, imagefolder, mnist
from ddpkit.errors import ConfigError, DataError
from ddpkit.models.builtin import MnistCNN
from ddpkit.registry import DATASETS, MODELS, OPTIMIZERS
from ddpkit.training.optim import build_optimizer, lr_factor


def test_builtin_and_torchvision_models():
    cnn = MODELS.build("mnist_cnn", key="model.name", kwargs={})
    assert isinstance(cnn, MnistCNN)
    assert cnn(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    layers = [m for m in cnn.modules() if isinstance(m, (nn.Conv2d, nn.Linear, nn.Dropout2d))]
    assert [type(m).__name__ for m in layers] == ["Conv2d", "Conv2d", "Dropout2d", "Linear", "Linear"]
    resnet = MODELS.build("resnet18", key="model.name", kwargs={"num_classes": 7})
    assert resnet(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_unknown_model_suggests_a_name():
    with pytest.raises(ConfigError, match=r"model.name: unknown model 'resnt18'; did you mean 'resnet18'\?"):
        MODELS.get("resnt18", key="model.name")


def test_bad_kwargs_name_the_config_key():
    with pytest.raises(ConfigError, match=r"model.kwargs: .*'widht'.* accepts: in_features, hidden, num_classes"):
        MODELS.build("mlp", key="model.name", kwargs={"widht": 3})


def test_user_registration_and_import_paths():
    @ddpkit.register_model("tiny_for_test")
    def tiny(width: int = 3) -> nn.Module:
        return nn.Linear(2, width)

    assert MODELS.build("tiny_for_test", key="model.name", kwargs={"width": 5}).out_features == 5
    assert "tiny_for_test" in MODELS.names()
    linear = MODELS.build("torch.nn:Linear", key="model.name", kwargs={"in_features": 2, "out_features": 4})
    assert isinstance(linear, nn.Linear)
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg'"):
        MODELS.get("no_such_pkg:thing", key="model.name")
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        MODELS.get("torch.nn:Nope", key="model.name")


def test_datasets_registered_and_missing_files_are_clear(tmp_path):
    assert {"digits", "fake", "mnist", "fashion_mnist", "cifar10", "imagefolder", "synthetic"} <= set(DATASETS.names())
    with pytest.raises(DataError, match=r"MNIST files not found under .*put the files at .*MNIST/raw"):
        mnist(root=str(tmp_path))
    with pytest.raises(DataError, match="needs a local root"):
        fashion_mnist()
    with pytest.raises(DataError, match="is not a directory"):
        imagefolder(root=str(tmp_path / "missing"))


def test_optimizers_by_name():
    params = [nn.Parameter(torch.zeros(2))]
    assert set(OPTIMIZERS.names()) >= {"sgd", "adam", "adamw"}
    sgd = build_optimizer(params, OptimConfig(name="sgd", lr=0.1, momentum=0.9, kwargs={"nesterov": True}))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["nesterov"]
    adamw = build_optimizer(params, OptimConfig(name="adamw", lr=0.001, kwargs={"betas": [0.8, 0.9]}))
    assert isinstance(adamw, torch.optim.AdamW)
    with pytest.raises(ConfigError, match=r"optim.kwargs: .*'betaz'"):
        build_optimizer(params, OptimConfig(name="adam", lr=0.1, kwargs={"betaz": 1}))


def test_schedules():
    warm_cos = SchedConfig(name="cosine", warmup_steps=10, min_lr=0.0)
    assert lr_factor(0, warm_cos, base_lr=1.0, total_steps=110) == pytest.approx(0.1)
    assert lr_factor(10, warm_cos, base_lr=1.0, total_steps=110) == pytest.approx(1.0)
    assert lr_factor(60, warm_cos, base_lr=1.0, total_steps=110) == pytest.approx(0.5)
    assert lr_factor(110, warm_cos, base_lr=1.0, total_steps=110) == pytest.approx(0.0)
    linear = SchedConfig(name="linear", min_lr=0.1)
    assert lr_factor(50, linear, base_lr=1.0, total_steps=100) == pytest.approx(0.55)
    step = SchedConfig(name="step", step_size=10, gamma=0.5)
    assert lr_factor(25, step, base_lr=1.0, total_steps=100) == pytest.approx(0.25)
