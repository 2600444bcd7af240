"""The privacy ledger: ε per step composed with the data set's other runs, the stop rule, resuming, and the
book that charges every run on a private data set."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from vip_core.privacy.accounting import composed_epsilon, compute_epsilon
from vip_core.privacy.ledger import Charge, LedgerBook, PrivacyLedger

SETTING = dict(noise_multiplier=1.0, sample_rate=0.1, delta=1e-5, accountant="pld")


def _ledger(steps: int = 0, prior=()) -> PrivacyLedger:
    return PrivacyLedger(SETTING["noise_multiplier"], SETTING["sample_rate"], SETTING["delta"],
                         SETTING["accountant"], prior=prior, steps=steps)


def test_epsilon_after_each_step_is_the_accountants_value_for_that_many_steps():
    ledger = _ledger()
    assert ledger.epsilon == 0.0
    reported = []
    for _ in range(5):
        ledger.record_step()
        reported.append(ledger.epsilon)
    assert reported == [compute_epsilon(steps=t, **SETTING) for t in range(1, 6)]
    assert reported == sorted(reported) and ledger.steps == 5


def test_can_step_stops_before_the_target_would_be_passed():
    ledger = _ledger()
    target = compute_epsilon(steps=4, **SETTING)
    while ledger.can_step(target):
        ledger.record_step()
    assert ledger.steps == 4
    assert ledger.epsilon <= target < ledger.epsilon_after(5)


def test_the_most_steps_a_target_allows_match_a_step_by_step_search():
    for target in (0.5, 1.3, 2.0):
        by_search = _ledger().max_steps(target)
        assert compute_epsilon(steps=by_search, **SETTING) <= target < compute_epsilon(steps=by_search + 1, **SETTING)


def test_a_ledger_composes_its_steps_with_the_data_sets_earlier_runs():
    earlier = Charge("earlier", 0.8, 0.05, 30, "pretrain-dp")
    ledger = _ledger(prior=[earlier])
    ledger.record_step()
    ledger.record_step()
    expected = composed_epsilon([(0.8, 0.05, 30), (1.0, 0.1, 2)], delta=1e-5, accountant="pld")
    assert ledger.epsilon == pytest.approx(expected)
    assert ledger.epsilon > compute_epsilon(steps=2, **SETTING)  # the earlier run is not forgotten
    assert ledger.summary()["composed_with"] == [{"run": "earlier", "noise_multiplier": 0.8, "sample_rate": 0.05,
                                                  "steps": 30, "purpose": "pretrain-dp"}]


def test_state_dict_round_trip_continues_the_count_and_the_prior():
    ledger = _ledger(prior=[Charge("earlier", 2.0, 0.1, 5, "dp-finetune")])
    for _ in range(3):
        ledger.record_step()
    resumed = PrivacyLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert resumed.steps == 3 and resumed.epsilon == ledger.epsilon and resumed.prior == ledger.prior


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sample_rate"):
        PrivacyLedger(1.0, 0.0, 1e-5, "pld")
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(1.0, 0.1, 1e-5, "moments")


def test_the_book_keeps_one_charge_per_run_and_composes_them(tmp_path):
    book = LedgerBook.for_data_set("abc123", tmp_path / "ledgers")
    with book.locked():
        book.charge(Charge("run-1", 1.0, 0.1, 10, "pretrain-dp"))
        book.charge(Charge("run-2", 2.0, 0.2, 5, "dp-finetune"))
        book.charge(Charge("run-1", 1.0, 0.1, 7, "pretrain-dp"))  # run-1 settled with the steps it took
    reread = LedgerBook.for_data_set("abc123", tmp_path / "ledgers")
    assert [c.run for c in reread.charges()] == ["run-1", "run-2"]
    assert reread.charges()[0].steps == 7
    assert [c.run for c in reread.charges(excluding="run-1")] == ["run-2"]
    assert reread.epsilon(delta=1e-5, accountant="rdp") == composed_epsilon(
        [(1.0, 0.1, 7), (2.0, 0.2, 5)], delta=1e-5, accountant="rdp")
    assert book.path == tmp_path / "ledgers" / "abc123.json"


def test_a_book_file_of_another_data_set_is_refused(tmp_path):
    path = tmp_path / "book.json"
    book = LedgerBook(path, "one")
    with book.locked():
        book.charge(Charge("r", 1.0, 0.1, 1, "pretrain-dp"))
    with pytest.raises(ValueError, match="ledger of data set one, not two"):
        LedgerBook(path, "two").charges()


def _charge_many(path: str, worker: int) -> None:
    book = LedgerBook(path, "shared")
    for i in range(20):
        with book.locked():
            book.charge(Charge(f"w{worker}-{i}", 1.0, 0.1, 1, "pretrain-dp"))


def test_concurrent_runs_never_lose_each_others_charges(tmp_path):
    path = str(tmp_path / "book.json")
    processes = [multiprocessing.get_context("spawn").Process(target=_charge_many, args=(path, w)) for w in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert len(LedgerBook(path, "shared").charges()) == 60
