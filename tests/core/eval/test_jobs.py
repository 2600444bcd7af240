"""The evaluation jobs on small real data: scikit-learn's digits (upsampled) and generated COCO/ADE20K sets,
with the tiny preset's randomly initialised encoder."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.fixtures.eval_sets import make_ade20k_shapes, make_coco_shapes, make_digits_imagefolder
from vip_core.config import FinetunePrivacyConfig, tiny
from vip_core.eval.fit import EpochCheckpoint
from vip_core.eval.jobs import TRAINING_STATE, prepare_job
from vip_core.models import build_encoder
from vip_core.privacy.accounting import compute_epsilon


CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    make_digits_imagefolder(root, img_size=32, per_class=30)
    return root


def random_encoder(seed: int = 0):
    torch.manual_seed(seed)
    return build_encoder(tiny().model)


def test_linear_probe_on_random_features_beats_chance_clearly(digits):
    config = tiny()
    metrics = prepare_job("linprobe", digits, config.evaluation, config.model, CPU)(random_encoder())
    assert metrics["chance_top1"] == pytest.approx(0.1)
    assert metrics["top1"] >= 0.2, metrics
    assert metrics["top1"] <= metrics["top5"] <= 1.0


def test_dp_finetune_reports_the_privacy_spent_within_the_target(digits, tmp_path):
    config = tiny()
    private = FinetunePrivacyConfig(enabled=True, target_epsilon=8.0, batch_size=32, physical_batch_size=16, steps=3,
                                    noise_multiplier=1.0)
    evaluation = config.evaluation.model_copy(update={"finetune_privacy": private})
    encoder = random_encoder()
    before = encoder.blocks[0].mlp.fc1.weight.detach().clone()
    metrics = prepare_job("finetune", digits, evaluation, config.model, CPU, ledgers=tmp_path)(encoder)
    expected = compute_epsilon(noise_multiplier=1.0, sample_rate=32 / 240, steps=3, delta=1 / 480, accountant="prv")
    assert metrics["dp_epsilon"] == pytest.approx(expected, rel=0.05) and 0 < expected <= 8.0
    assert metrics["dp_delta"] == pytest.approx(1 / (2 * 240))
    assert metrics["dp_sample_rate"] == pytest.approx(32 / 240)
    assert metrics["dp_noise_multiplier"] > 0
    assert not torch.equal(before, encoder.blocks[0].mlp.fc1.weight), "DP steps updated the encoder"
    assert 0.0 <= metrics["top1"] <= metrics["top5"] <= 1.0


def test_dp_finetune_leaves_out_damaged_images_and_takes_an_empty_sample(digits, tmp_path):
    """A damaged image in the private set is a null sample, as in pre-training: a failed job would tell that it was
    sampled. Every image is sampled here (q = 1)."""
    import shutil

    from vip_core.eval.dp_finetune import _gather
    from vip_core.eval.datasets import ImageFolderDataset

    data = tmp_path / "digits"
    shutil.copytree(digits, data)
    (data / "train" / "0" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    train_size = sum(1 for _ in (data / "train").rglob("*.png"))
    private = FinetunePrivacyConfig(enabled=True, target_epsilon=1e6, batch_size=train_size,
                                    physical_batch_size=64, steps=2, noise_multiplier=1.0)
    config = tiny()
    evaluation = config.evaluation.model_copy(update={"finetune_privacy": private})
    metrics = prepare_job("finetune", data, evaluation, config.model, CPU, ledgers=tmp_path / "ledgers")(
        random_encoder())
    assert metrics["dp_sample_rate"] == 1.0 and 0.0 <= metrics["top1"] <= 1.0
    dataset = ImageFolderDataset(data / "train", {str(k): k for k in range(10)}, 32)
    images, labels = _gather(dataset, torch.tensor([], dtype=torch.long), (32, 32))
    assert images.shape == (0, 3, 32, 32) and images.dtype == torch.uint8 and labels.shape == (0,)


PAPER_REGULARISERS = {"finetune_drop_path": 0.1, "finetune_mixup": 0.8, "finetune_cutmix": 1.0,
                      "finetune_label_smoothing": 0.1, "finetune_randaugment": 9, "finetune_epochs": 1}


def test_public_finetuning_with_the_papers_regularisers_is_deterministic_for_its_seed(digits, tmp_path):
    config = tiny()
    evaluation = config.evaluation.model_copy(update=PAPER_REGULARISERS)
    for name, seed in (("first", 0), ("second", 0), ("other", 1)):
        job = prepare_job("finetune", digits, evaluation.model_copy(update={"seed": seed}), config.model, CPU)
        job(random_encoder(), workspace=tmp_path / name)
    first, second, other = (_trained_weights(tmp_path / name) for name in ("first", "second", "other"))
    assert _same_weights(first, second)
    assert not _same_weights(first, other)


def test_dp_finetuning_leaves_mixup_and_cutmix_off_and_says_so(digits, tmp_path, caplog):
    config = tiny()
    private = FinetunePrivacyConfig(enabled=True, target_epsilon=8.0, batch_size=32, physical_batch_size=16, steps=2,
                                    noise_multiplier=1.0)
    evaluation = config.evaluation.model_copy(update={**PAPER_REGULARISERS, "finetune_privacy": private})
    with caplog.at_level("WARNING"):
        metrics = prepare_job("finetune", digits, evaluation, config.model, CPU, ledgers=tmp_path)(random_encoder())
    assert "finetune_mixup and finetune_cutmix are left off in DP fine-tuning" in caplog.text
    assert 0.0 <= metrics["top1"] <= 1.0
    assert metrics["mixup_used"] == metrics["cutmix_used"] == 0.0  # what ran, beside the config that asked


@pytest.mark.parametrize("private, problem", [
    (FinetunePrivacyConfig(enabled=True, batch_size=10_000),
     r"evaluation\.finetune_privacy\.batch_size: 10000 is larger than the data set \(240 examples\)"),
    (FinetunePrivacyConfig(enabled=True, batch_size=32, noise_multiplier=0.1, steps=50),
     r"evaluation\.finetune_privacy\.noise_multiplier: .* above evaluation\.finetune_privacy\.target_epsilon 8\.0"),
])
def test_dp_finetune_settings_that_cannot_hold_fail_before_training(digits, private, problem, tmp_path):
    config = tiny()
    evaluation = config.evaluation.model_copy(update={"finetune_privacy": private})
    with pytest.raises(ValueError, match=problem):
        prepare_job("finetune", digits, evaluation, config.model, CPU, ledgers=tmp_path)


def test_detection_without_masks_uses_boxes_only(tmp_path):
    make_coco_shapes(tmp_path, img_size=32, n=8)
    for path in (tmp_path / "annotations").glob("*.json"):
        data = json.loads(path.read_text())
        for ann in data["annotations"]:
            ann.pop("segmentation")
        path.write_text(json.dumps(data))
    config = tiny()
    metrics = prepare_job("coco", tmp_path, config.evaluation, config.model, CPU)(random_encoder())
    assert "ap_mask" not in metrics
    assert 0.0 <= metrics["ap_box"] <= 1.0 and 0.0 <= metrics["ap50_box"] <= 1.0


def test_unknown_task_and_bad_pyramid_size_are_one_line_errors(tmp_path):
    config = tiny()
    with pytest.raises(ValueError, match="unknown task 'depth'"):
        prepare_job("depth", tmp_path, config.evaluation, config.model, CPU)
    make_ade20k_shapes(tmp_path, img_size=16, n=4)
    evaluation = config.evaluation.model_copy(update={"segmentation_img_size": 36})
    with pytest.raises(ValueError, match="segmentation_img_size: 36 is not a multiple of 2 x patch_size"):
        prepare_job("ade20k", tmp_path, evaluation, config.model, CPU)


def _trained_weights(workspace) -> dict:
    """The model state a job kept after its last epoch."""
    return torch.load(workspace / TRAINING_STATE, weights_only=True)["model"]


def _same_weights(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


def test_an_interrupted_fine_tuning_resumes_after_its_last_epoch_and_ends_as_an_uninterrupted_one(
        digits, tmp_path, monkeypatch, caplog):
    config = tiny()
    evaluation = config.evaluation.model_copy(update={**PAPER_REGULARISERS, "finetune_epochs": 2})
    job = prepare_job("finetune", digits, evaluation, config.model, CPU)
    whole = job(random_encoder(), workspace=tmp_path / "whole")
    save = EpochCheckpoint.save

    def killed_after_the_first_epoch(self, state):
        save(self, state)
        if state["epoch"] == 1:
            raise KeyboardInterrupt("the job was stopped")

    with monkeypatch.context() as patch:
        patch.setattr(EpochCheckpoint, "save", killed_after_the_first_epoch)
        with pytest.raises(KeyboardInterrupt):
            job(random_encoder(), workspace=tmp_path / "cut")
    with caplog.at_level("INFO"):
        resumed = job(random_encoder(), workspace=tmp_path / "cut")
    assert "fine-tune resumes after epoch 1" in caplog.text
    assert resumed == whole
    assert _same_weights(_trained_weights(tmp_path / "cut"), _trained_weights(tmp_path / "whole"))


def test_decoding_processes_change_no_number(digits, tmp_path):
    """Each image's crops, flips and RandAugment are keyed by the image and the epoch, not by the process that
    decodes it."""
    config = tiny()
    evaluation = config.evaluation.model_copy(update=PAPER_REGULARISERS)
    alone = prepare_job("finetune", digits, evaluation, config.model, CPU)(random_encoder(), workspace=tmp_path / "0")
    parallel = evaluation.model_copy(update={"loader_workers": 2})
    two = prepare_job("finetune", digits, parallel, config.model, CPU)(random_encoder(), workspace=tmp_path / "2")
    assert two == alone
    assert _same_weights(_trained_weights(tmp_path / "0"), _trained_weights(tmp_path / "2"))


def test_features_extracted_under_bf16_autocast_on_the_cpu_stay_near_float32(digits):
    from vip_core.eval.datasets import open_classification
    from vip_core.eval.features import extract_features
    from vip_core.eval.loading import Loading

    train = open_classification(digits).split("train", 32)
    options = dict(last_blocks=2, batch_size=64, loading=Loading(CPU))
    full, _ = extract_features(random_encoder(), train, **options)
    half, _ = extract_features(random_encoder(), train, precision="bf16", **options)
    assert not torch.equal(full, half)  # the forwards ran in bfloat16
    assert torch.nn.functional.cosine_similarity(full, half).min() > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_jobs_run_on_cuda_in_bf16_from_pinned_memory(digits, tmp_path):
    config = tiny()
    evaluation = config.evaluation.model_copy(update={"device": "cuda", "precision": "bf16", "loader_workers": 2})
    for task in ("linprobe", "finetune", "fewshot"):
        job = prepare_job(task, digits, evaluation, config.model, torch.device("cuda"))
        metrics = job(random_encoder(), workspace=tmp_path / task)
        assert all(0.0 <= value <= 1.0 for value in metrics.values()), (task, metrics)
