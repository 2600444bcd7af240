"""The privacy plan of a private pre-training run: q, δ and σ for the measured dataset size.

The dataset size is measured, never typed in: the plan turns the public hyperparameters of a
:class:`~vip_core.config.VipConfig` and the measured N into the numbers the DP engine and the ledger use.
"""

from __future__ import annotations

import dataclasses
import logging

from vip_core.config import ConfigError, VipConfig
from vip_core.privacy.accounting import calibrate_noise_multiplier, compute_epsilon

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    """What a private stage runs with.

    Attributes:
        dataset_size: N, the measured number of private examples.
        batch_size: B, the expected logical batch size.
        sample_rate: q = B / N, the Poisson sampling probability.
        steps: the planned number of logical steps.
        delta: δ; 1/(2N) unless configured.
        noise_multiplier: σ; calibrated to ``target_epsilon`` unless configured.
        max_grad_norm: C, the per-sample clipping norm.
        target_epsilon: the budget ε the run must not pass.
        epsilon: ε the accountant reports after ``steps`` steps (<= ``target_epsilon``).
        accountant: the accountant's name.
    """

    dataset_size: int
    batch_size: int
    sample_rate: float
    steps: int
    delta: float
    noise_multiplier: float
    max_grad_norm: float
    target_epsilon: float
    epsilon: float
    accountant: str


def plan_privacy(config: VipConfig, dataset_size: int) -> PrivacyPlan:
    """The plan of ``config``'s private stage over ``dataset_size`` examples.

    Raises:
        ConfigError: privacy is disabled, the batch is larger than the dataset, or a configured σ
            overspends the budget; the message names the field.
    """
    privacy, training = config.privacy, config.private
    if not privacy.enabled:
        raise ConfigError("privacy.enabled: privacy is disabled, so there is no privacy plan")
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1:
        raise ConfigError(f"dataset_size: must be a positive integer, got {dataset_size!r}")
    if training.batch_size > dataset_size:
        raise ConfigError(
            f"private.batch_size: {training.batch_size} is larger than the dataset ({dataset_size} examples)"
        )
    sample_rate = training.batch_size / dataset_size
    delta = privacy.delta if privacy.delta is not None else 1.0 / (2 * dataset_size)
    if delta >= 1.0 / dataset_size:
        log.warning("delta %.3g is not below 1/N = %.3g: the guarantee is weak", delta, 1.0 / dataset_size)
    accounting = dict(sample_rate=sample_rate, steps=training.steps, delta=delta, accountant=privacy.accountant)
    sigma = privacy.noise_multiplier
    if sigma is None:
        sigma = calibrate_noise_multiplier(target_epsilon=privacy.target_epsilon, **accounting)
    epsilon = compute_epsilon(noise_multiplier=sigma, **accounting)
    if epsilon > privacy.target_epsilon:
        raise ConfigError(
            f"privacy.noise_multiplier: sigma {sigma} reaches epsilon {epsilon:.3f} after {training.steps} steps, "
            f"above privacy.target_epsilon {privacy.target_epsilon}"
        )
    return PrivacyPlan(
        dataset_size=dataset_size, batch_size=training.batch_size, sample_rate=sample_rate, steps=training.steps,
        delta=delta, noise_multiplier=float(sigma), max_grad_norm=privacy.max_grad_norm,
        target_epsilon=privacy.target_epsilon, epsilon=epsilon, accountant=privacy.accountant,
    )
