"""The privacy plan: q and δ from the measured dataset size, σ calibrated against the data set's ledger,
a batch larger than N refused, and the book charged before any step."""

from __future__ import annotations

import dataclasses

import pytest

from vip_core.config import ConfigError, PrivacyConfig, get_preset, with_overrides
from vip_core.privacy.accounting import composed_epsilon, compute_epsilon
from vip_core.privacy.ledger import Charge, LedgerBook
from vip_core.privacy.plan import PrivacyPlan, plan_and_charge, plan_privacy

PAPER_N = 233_804_767


def stage_plan(config, dataset_size: int, **extra) -> PrivacyPlan:
    return plan_privacy(config.privacy, dataset_size=dataset_size, batch_size=config.private.batch_size,
                        steps=config.private.steps, fingerprint="data", **extra)


def test_paper_preset_keeps_the_papers_noise_and_reports_its_rdp_epsilon():
    plan = stage_plan(get_preset("vip-base-paper"), PAPER_N)
    assert plan.noise_multiplier == 0.48 and plan.accountant == "rdp"
    assert plan.epsilon == pytest.approx(7.99, abs=0.01)  # the paper's ε = 8
    pld = compute_epsilon(noise_multiplier=0.48, sample_rate=plan.sample_rate, steps=plan.steps, delta=plan.delta)
    assert pld == pytest.approx(6.83, abs=0.01)


def test_the_paper_presets_plan_shows_the_tight_pld_epsilon_beside_the_papers_rdp_one():
    plan = stage_plan(get_preset("vip-base-paper"), PAPER_N)
    assert plan.tight_epsilon() == pytest.approx(6.83, abs=0.01)
    assert plan.epsilon_by("rdp") == plan.epsilon
    assert plan.describe_epsilon() == "ε 7.99 (rdp; pld 6.83)"
    assert plan.tight_epsilon(steps=3_000) < plan.tight_epsilon()
    calibrated = stage_plan(get_preset("vip-base"), PAPER_N)
    assert calibrated.tight_epsilon() is None and calibrated.describe_epsilon() == "ε 7.99 (pld)"


def test_base_preset_gets_sigma_calibrated_to_epsilon_eight_for_the_measured_size():
    config = get_preset("vip-base")
    assert config.privacy.noise_multiplier is None  # not typed in
    plan = stage_plan(config, PAPER_N)
    assert plan.sample_rate == pytest.approx(98_304 / PAPER_N)
    assert plan.delta == pytest.approx(1 / (2 * PAPER_N))
    assert plan.steps == 6_000 and plan.max_grad_norm == 0.1 and plan.target_epsilon == 8.0
    assert 7.9 < plan.epsilon <= 8.0
    assert plan.epsilon == compute_epsilon(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                                           steps=plan.steps, delta=plan.delta, accountant=plan.accountant)
    assert 0.44 < plan.noise_multiplier < 0.48


def test_a_larger_dataset_needs_less_noise():
    config = with_overrides(get_preset("tiny"), {"private.steps": 50})
    small, large = stage_plan(config, 1_000), stage_plan(config, 10_000)
    assert large.noise_multiplier < small.noise_multiplier
    assert small.epsilon <= 8.0 and large.epsilon <= 8.0


def test_batch_larger_than_dataset_fails_naming_the_field():
    config = get_preset("tiny")
    with pytest.raises(ConfigError, match=r"private\.batch_size"):
        stage_plan(config, config.private.batch_size - 1)


def test_configured_sigma_and_delta_are_used():
    config = with_overrides(get_preset("tiny"), {"privacy.noise_multiplier": 2.0, "privacy.delta": 1e-6})
    plan = stage_plan(config, 1_000)
    assert plan.noise_multiplier == 2.0 and plan.delta == 1e-6
    assert plan.epsilon == compute_epsilon(noise_multiplier=2.0, sample_rate=64 / 1_000, steps=10, delta=1e-6)


def test_configured_sigma_that_overspends_the_budget_is_refused():
    config = with_overrides(get_preset("tiny"), {"privacy.noise_multiplier": 0.3})
    with pytest.raises(ConfigError, match=r"privacy\.noise_multiplier"):
        stage_plan(config, 1_000)


def test_plan_is_frozen_and_round_trips_through_json_ready_fields():
    plan = stage_plan(get_preset("tiny"), 1_000, prior=[Charge("r", 1.0, 0.1, 3, "pretrain-dp")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.noise_multiplier = 0.0
    assert PrivacyPlan.from_dict(plan.to_dict()) == plan


def test_earlier_runs_on_the_data_set_are_composed_and_leave_less_budget():
    config = get_preset("tiny")
    first = stage_plan(with_overrides(config, {"privacy.target_epsilon": 4.0}), 1_000)
    second = stage_plan(config, 1_000, prior=[first.charge("first", "pretrain-dp")])
    alone = stage_plan(config, 1_000)
    assert second.noise_multiplier > alone.noise_multiplier
    composed = composed_epsilon([(first.noise_multiplier, first.sample_rate, first.steps),
                                 (second.noise_multiplier, second.sample_rate, second.steps)],
                                delta=second.delta, accountant=second.accountant)
    assert second.epsilon == pytest.approx(composed) and composed <= 8.0


def test_a_spent_budget_is_refused_naming_the_field_and_the_runs_that_spent_it():
    config = get_preset("tiny")
    spent = Charge("old-run", 0.2, 0.5, 500, "pretrain-dp")
    with pytest.raises(ConfigError, match=r"privacy\.target_epsilon: 8.0 cannot be met.*pretrain-dp old-run"):
        stage_plan(config, 1_000, prior=[spent])


def test_several_runs_of_one_plan_are_calibrated_to_compose_within_the_target():
    private = with_overrides(get_preset("tiny"), {"evaluation.finetune_privacy.enabled": True}).evaluation.finetune_privacy
    n = 1_281_167  # ImageNet-1K: one run calibrated alone and charged twice would compose above the target
    one = plan_privacy(private, dataset_size=n, batch_size=private.batch_size, steps=private.steps, fingerprint="in")
    two = plan_privacy(private, dataset_size=n, batch_size=private.batch_size, steps=private.steps, fingerprint="in",
                       runs=2)
    twice_one = compute_epsilon(noise_multiplier=one.noise_multiplier, sample_rate=one.sample_rate,
                                steps=2 * one.steps, delta=one.delta, accountant=one.accountant)
    assert twice_one > private.target_epsilon  # what reporting one run's ε would hide
    assert two.epsilon <= private.target_epsilon and two.noise_multiplier > one.noise_multiplier


def test_plan_and_charge_charges_the_planned_steps_of_every_run(tmp_path):
    book = LedgerBook.for_data_set("data", tmp_path)
    config = get_preset("tiny")
    planning = dict(dataset_size=1_000, batch_size=64, steps=10, fingerprint="data")
    half = config.privacy.model_copy(update={"target_epsilon": 4.0})
    plan = plan_and_charge(book, runs=["a", "b"], purpose="dp-finetune", budget=half, **planning)
    assert [(c.run, c.steps, c.noise_multiplier) for c in book.charges()] == [
        ("a", 10, plan.noise_multiplier), ("b", 10, plan.noise_multiplier)]
    again = plan_and_charge(book, runs=["c"], purpose="pretrain-dp", budget=config.privacy, **planning)
    assert {c.run for c in again.prior} == {"a", "b"} and len(book.charges()) == 3
    assert book.epsilon(delta=again.delta, accountant=again.accountant) <= 8.0


def test_epsilon_by_counts_the_earlier_runs_of_a_plan_as_its_ledger_does():
    budget = PrivacyConfig(noise_multiplier=1.0, max_grad_norm=1.0, target_epsilon=1e6, delta=1e-5, accountant="rdp")
    plan = plan_privacy(budget, dataset_size=10_000, batch_size=100, steps=2_000, fingerprint="data", runs=2)
    ledger = plan.ledger(earlier_runs=1)  # its steps start at the first run's 2,000
    second_run = ledger.epsilon_after(ledger.steps + 1_000)
    assert plan.epsilon_by("rdp", 1_000, earlier_runs=1) == pytest.approx(second_run, rel=1e-9)
    assert plan.epsilon_by("rdp", 1_000) < second_run  # counting the running run alone under-reports
    assert plan.tight_epsilon(1_000, earlier_runs=1) > plan.tight_epsilon(1_000)


def test_strict_float32_reaches_the_plan_and_a_resume_may_change_it():
    # Both numerics keep every contribution within C (docs/privacy.md, rule 12): a run resumed with the other one
    # keeps its guarantee, and a plan saved with the older tensor_core_sums field still loads.
    plan = stage_plan(get_preset("tiny"), 1_000)
    strict = stage_plan(with_overrides(get_preset("tiny"), {"privacy.strict_float32": True}), 1_000)
    assert (plan.strict_float32, strict.strict_float32) == (False, True)
    assert plan.mismatch(strict.to_dict()) is None
    older = {**plan.to_dict(), "tensor_core_sums": False}
    assert PrivacyPlan.from_dict(older) == plan
