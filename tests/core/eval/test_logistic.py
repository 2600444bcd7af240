import pytest
import torch

from vip_core.eval.logistic import converged_probe, cross_validated_l2, fit_logistic, predict, standardise


def _blobs(n: int, seed: int, separation: float = 6.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=generator)
    centres = torch.tensor([[0.0, 0.0], [separation, 0.0], [0.0, separation]])
    return centres[labels] + torch.randn(n, 2, generator=generator), labels


def test_the_probe_converges_on_separable_classes_and_reports_each_test_example():
    result = converged_probe(_blobs(300, 0), _blobs(200, 1), num_classes=3, grid=(1e-3, 1e-1))
    assert result.top1 > 0.9 and result.l2 in (1e-3, 1e-1)
    assert result.correct.shape == (200,) and result.correct.dtype == torch.bool
    assert result.correct.double().mean().item() == result.top1


def test_the_fit_reaches_a_stationary_point():
    features, labels = standardise(*(_blobs(200, 2)[0],) * 2)[0], _blobs(200, 2)[1]
    weight, bias = fit_logistic(features, labels, 3, l2=1e-2)
    weight.requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(features @ weight + bias, labels) + 0.5e-2 * weight.pow(2).sum()
    (gradient,) = torch.autograd.grad(loss, weight)
    assert gradient.abs().max() < 1e-4
    assert (predict(weight.detach(), bias, features) == labels).double().mean() > 0.8


def test_cross_validation_needs_two_folds():
    features, labels = _blobs(30, 3)
    with pytest.raises(ValueError, match="folds must be >= 2"):
        cross_validated_l2(features.double(), labels, 3, folds=1)
