"""The stages of ``make reproduce`` besides the pipeline's own (render and pre-training, reused as they are):
the offline data sets, the evaluation of every arm of one seed, and the report.

* :func:`write_private_set`: unlabelled object images (``vip_core.data.objects``, the photographs' private
  region) as webdataset shards of PNGs, the pre-training stage's input. Each private run gets its own set.
* :func:`write_downstream_set`: one labelled downstream task (``vip_core.data.downstream``: shapes on the
  photographs' other region, procedural textures, counting) in ImageFolder layout (``train/<class>/``,
  ``val/<class>/``), the layout the evaluation jobs read.
* :func:`evaluate_seed`: the converged linear probe (``vip_core.eval.logistic``) on the mean-pooled patch
  tokens of every block of each arm's encoder, and on raw pixels, on one task; whether each test example was
  right is kept (``correct.npz``) for the paired statistics.
* :func:`write_report`: the verdicts per task (``vip_core.reproduce.judge``), the Markdown table and the PNG
  plot.

Each writes its folder whole (``vip_core.atomic``) with a ``result.json``; called again with the same
settings it returns that result, with other settings it refuses (one line naming the folder).
The downstream set is public evaluation data; the private sets are the data the (ε, δ) guarantee covers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from vip_core.atomic import PARTIAL_SUFFIX, atomic_path, create_text, write_json
from vip_core.data.downstream import TASK_KINDS, generate_task
from vip_core.data.objects import ObjectStyle, iter_objects
from vip_core.reproduce import ARMS, DownstreamTask, ReproduceConfig, judge

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
CORRECT_FILE = "correct.npz"
PLOT_FILE = "reproduce.png"
TABLE_FILE = "reproduce.md"
SAMPLES_PER_SHARD = 5000
FEATURE_BATCH = 256


EXPERIMENT_FILE = "experiment.json"


def claim_workdir(root: str | Path, experiment: ReproduceConfig) -> None:
    """Records ``experiment`` in ``root`` (made if missing), or checks that ``root`` holds its runs: the flow's
    stages resume and reuse what a folder holds, so the runs of another experiment there (another recipe,
    seed or size) would be continued or reused as if they were this one's. The record is created exclusively
    (of two flows starting on one empty folder, the second is checked against the first's record); it is a
    check, not a lock: two flows of the same experiment may share the folder.

    Raises:
        ValueError: ``root`` holds another experiment's runs, or runs that no experiment file describes
            (one line naming the folder and the first setting that differs).
    """
    root = Path(root)
    record = root / EXPERIMENT_FILE
    if not record.is_file():
        if root.is_dir() and any(not entry.name.endswith(PARTIAL_SUFFIX) for entry in root.iterdir()):
            raise ValueError(f"{root} holds runs that no {EXPERIMENT_FILE} describes (made before vip recorded "
                             "experiments, or by hand): pass another workdir or move it aside")
        if create_text(record, json.dumps(experiment.model_dump(mode="json"), indent=2)):
            return
    held = _held_experiment(record)
    if held is None:
        raise ValueError(f"{root} holds the runs of an experiment that this version cannot read ({EXPERIMENT_FILE}): "
                         "pass another workdir or move that one aside")
    if held != experiment:
        key, there, now = _first_difference(held.model_dump(mode="json"), experiment.model_dump(mode="json"))
        raise ValueError(f"{root} holds the runs of another experiment ({key} is {there!r} there, {now!r} now): "
                         "pass another workdir or move that one aside")


def _held_experiment(record: Path) -> ReproduceConfig | None:
    """The experiment ``record`` describes (settings added since filled with their defaults); None when this
    version cannot read it (e.g. a setting removed since)."""
    try:
        return ReproduceConfig.model_validate(json.loads(record.read_text()))
    except ValueError:  # pydantic's ValidationError and json's JSONDecodeError are ValueErrors
        return None


def _first_difference(held: Any, wanted: Any, key: str = "") -> tuple[str, Any, Any]:
    """The first dotted key where two JSON values differ, with both values there ("absent" where one lacks it)."""
    if isinstance(held, dict) and isinstance(wanted, dict):
        for name in sorted(set(held) | set(wanted)):
            if held.get(name, "absent") != wanted.get(name, "absent"):
                return _first_difference(held.get(name, "absent"), wanted.get(name, "absent"),
                                         f"{key}.{name}" if key else name)
    return key, held, wanted


# ---------------------------------------------------------------------------------------------------- data


def write_private_set(output: str | Path, count: int, seed: int, style: ObjectStyle = ObjectStyle()) -> dict[str, Any]:
    """``count`` unlabelled object images of the private region as shards in ``output``; returns a summary."""
    from PIL import Image

    from vip_core.data.shards import ShardWriter, encode_image

    settings = {"kind": "private-set", "count": count, "seed": seed, "style": asdict(style)}
    if (done := _finished(output, settings)) is not None:
        return done
    index = 0
    with atomic_path(output) as staging, ShardWriter(staging, samples_per_shard=SAMPLES_PER_SHARD) as writer:
        for images, _labels in iter_objects(count, seed, "private", style):  # labels dropped: unlabelled data
            for image in images:  # image: [S, S, 3] uint8
                writer.write(f"{index:07d}", {"png": encode_image(Image.fromarray(image), "png")})
                index += 1
    return _store(output, settings, {"output": str(output), "images": index})


def write_downstream_set(output: str | Path, task: DownstreamTask, train: int, test: int,
                         size: int = 32) -> dict[str, Any]:
    """A labelled ImageFolder set of one downstream task: ``train`` then ``test`` images of ``size`` px from
    the task's generator at its data seed; returns a summary."""
    from PIL import Image

    settings = {"kind": "downstream-set", "task": task.kind, "train": train, "test": test, "seed": task.data_seed,
                "size": size}
    if (done := _finished(output, settings)) is not None:
        return done
    classes = TASK_KINDS[task.kind].classes
    images, labels = generate_task(task.kind, train + test, task.data_seed, size)  # [N, S, S, 3], [N]
    with atomic_path(output) as staging:
        for split in ("train", "val"):
            for name in classes:
                (staging / split / name).mkdir(parents=True)
        for index, (image, label) in enumerate(zip(images, labels)):
            split = "train" if index < train else "val"
            Image.fromarray(image).save(staging / split / classes[label] / f"{index:06d}.png")
    return _store(output, settings, {"output": str(output), "task": task.name, "train": train, "val": test,
                                     "classes": len(classes)})


def _finished(output: str | Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The stored result of ``output`` made with ``settings``; None when there is none; other settings refused."""
    result_file = Path(output) / RESULT_FILE
    if not result_file.is_file():
        return None
    stored = json.loads(result_file.read_text())
    if stored.get("settings") != settings:
        raise ValueError(f"{output} holds a {stored.get('settings', {}).get('kind', 'folder')} made with other "
                         "settings: choose another output")
    return stored["result"]


def _store(output: str | Path, settings: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    write_json(Path(output) / RESULT_FILE, {"settings": settings, "result": result})
    return result


# ------------------------------------------------------------------------------------------------ evaluate


def evaluate_seed(experiment: ReproduceConfig, seed: int | None, checkpoints: Mapping[str, str], data: str | Path,
                  output: str | Path) -> dict[str, Any]:
    """Probes every encoder arm of one seed (``seed`` None: the raw pixels, the same for every seed) on the
    downstream set; writes ``correct.npz`` and ``result.json``.

    Args:
        experiment: the experiment (model size, the probe's penalty grid and folds).
        seed: the seed whose random-init weights are the ``random-init`` arm; None: ``raw-pixels`` only.
        checkpoints: the trained arms' checkpoints, ``{arm: checkpoint folder}``.
        data: the downstream set (ImageFolder layout).
        output: the folder for ``correct.npz`` and ``result.json``.

    Returns:
        ``{"seed", "arms": {arm: {"top1", "l2", "features"[, "blocks_top1"]}}, "correct": path of correct.npz}``;
        ``blocks_top1`` (with ``experiment.block_probes``): the probe on each encoder block's pooled tokens alone,
        a diagnostic of where the features are, decided by no finding.
    """
    from vip_core.eval.datasets import open_classification

    settings = {"kind": "evaluation", "seed": seed, "checkpoints": dict(checkpoints), "data": str(data),
                "model": experiment.vip.model.model_dump(mode="json"), "grid": list(experiment.probe_l2_grid),
                "folds": experiment.probe_folds, "block_probes": experiment.block_probes}
    if (done := _finished(output, settings)) is not None:
        return done
    unknown = set(checkpoints) - set(ARMS)
    if unknown:
        raise ValueError(f"checkpoints: unknown arms {sorted(unknown)} (known: {', '.join(ARMS)})")
    dataset = open_classification(data)
    img_size = experiment.vip.model.img_size
    train, test = (_images(dataset.split(name, img_size)) for name in ("train", "val"))
    arms, correct = {}, {}
    for arm in _arms_of(experiment, seed):
        features = _arm_features(experiment, arm, seed, checkpoints, train[0], test[0])
        probe = _probe(experiment, features, train[1], test[1], dataset.num_classes)
        arms[arm] = {"top1": probe.top1, "l2": probe.l2, "features": features[0].shape[1]}
        if experiment.block_probes and arm != "raw-pixels":
            arms[arm]["blocks_top1"] = _block_probes(experiment, features, train[1], test[1], dataset.num_classes)
        correct[arm] = probe.correct.numpy()
        log.info("seed %s, %s: top-1 %.4f (l2 %g)", seed, arm, probe.top1, probe.l2)
    with atomic_path(output) as staging:
        staging.mkdir()
        np.savez_compressed(staging / CORRECT_FILE, **correct)
    return _store(output, settings, {"seed": seed, "arms": arms, "correct": str(Path(output) / CORRECT_FILE)})


def _arms_of(experiment: ReproduceConfig, seed: int | None) -> tuple[str, ...]:
    """The arms one evaluation probes: the encoders of a seed, or (seed None) the raw pixels."""
    return tuple(arm for arm in experiment.arms if (arm == "raw-pixels") == (seed is None))


def _images(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """All of a split, normalised, ``([N, 3, H, W], [N])``."""
    from torch.utils.data import DataLoader

    from vip_core.train.data import normalise

    batches = list(DataLoader(dataset, batch_size=FEATURE_BATCH))
    return normalise(torch.cat([b[0] for b in batches])), torch.cat([torch.as_tensor(b[1]) for b in batches])


def _arm_features(experiment: ReproduceConfig, arm: str, seed: int, checkpoints: Mapping[str, str],
                  train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The arm's features of both splits: ``[N, depth * D]`` pooled tokens, or ``[N, 3 * H * W]`` pixels."""
    if arm == "raw-pixels":
        return train.flatten(1), test.flatten(1)
    encoder = _encoder(experiment, arm, seed, checkpoints)
    return _features(encoder, train), _features(encoder, test)


def _encoder(experiment: ReproduceConfig, arm: str, seed: int, checkpoints: Mapping[str, str]):
    """The arm's encoder: the checkpoint's, or the weights ``torch.manual_seed(seed)`` then ``build_mae`` give
    (exactly what the synthetic and DP-from-random runs of this seed start from)."""
    from vip_core.models.checkpoint import load_encoder
    from vip_core.models.mae import build_mae, export_encoder

    if arm != "random-init":
        if arm not in checkpoints:
            raise ValueError(f"checkpoints: no checkpoint for arm {arm!r} of seed {seed}")
        config = experiment.arm_config(arm, seed)
        return load_encoder(checkpoints[arm], config.model, weights=config.evaluation.encoder_weights)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return export_encoder(build_mae(experiment.vip.model))


def _features(encoder, images: torch.Tensor) -> torch.Tensor:
    """Mean-pooled patch tokens of every block, concatenated: ``[N, depth * D]``."""
    from vip_core.eval.features import pooled_block_features

    encoder.eval()
    with torch.no_grad():
        return torch.cat([pooled_block_features(encoder, batch, len(encoder.blocks))
                          for batch in images.split(FEATURE_BATCH)])  # [N, depth * D]


def _probe(experiment: ReproduceConfig, features, train_labels, test_labels, num_classes: int):
    from vip_core.eval.logistic import converged_probe

    return converged_probe((features[0], train_labels), (features[1], test_labels), num_classes,
                           grid=experiment.probe_l2_grid, folds=experiment.probe_folds)


def _block_probes(experiment: ReproduceConfig, features, train_labels, test_labels, num_classes: int) -> list[float]:
    """The probe's top-1 on each block's pooled tokens alone, first block first (``features``: both splits'
    ``[N, depth * D]`` concatenations of :func:`_features`)."""
    width = experiment.vip.model.embed_dim
    blocks = [slice(start, start + width) for start in range(0, features[0].shape[1], width)]
    return [_probe(experiment, (features[0][:, block], features[1][:, block]), train_labels, test_labels,
                   num_classes).top1 for block in blocks]


# -------------------------------------------------------------------------------------------------- report


def write_report(experiment: ReproduceConfig, evaluations: Mapping[str, list[Mapping[str, Any]]],
                 privacy: list[Mapping[str, Any]], output: str | Path) -> dict[str, Any]:
    """Judges the findings on every task, each on its seeds' evaluations; writes the table (Markdown) and the
    plot (PNG).

    Args:
        experiment: the experiment.
        evaluations: per task name (``DownstreamTask.name``), :func:`evaluate_seed`'s results, one per seed and
            one of the raw pixels.
        privacy: one entry per private run: ``arm``, ``seed``, ``epsilon``, ``delta``, ``noise_multiplier``,
            ``steps``, ``dataset_size``, ``sample_rate``.
        output: the report's folder.

    Returns:
        ``{"tasks": {name: {"description", "arms", "findings", "test_examples", "blocks"}}}`` (``arms`` and
        ``findings`` of :func:`vip_core.reproduce.judge`), with ``split`` (which tasks and seeds chose the
        recipe, which score it), ``recipe``, ``compute`` (FLOPs per arm), ``seeds``, ``privacy``, ``table``
        (Markdown), ``table_file`` and ``plot`` (the PNG's path).
    """
    missing = [task.name for task in experiment.tasks if task.name not in evaluations]
    if missing:
        raise ValueError(f"no evaluations of tasks {missing}")
    tasks = {task.name: _judge_task(experiment, task.describe(), evaluations[task.name]) for task in experiment.tasks}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    report = {"tasks": tasks, "split": experiment.describe_split(), "recipe": dict(experiment.recipe),
              "compute": experiment.compute(), "seeds": list(experiment.seeds), "privacy": [dict(p) for p in privacy]}
    table = markdown_table(experiment, report)
    (output / TABLE_FILE).write_text(table + "\n")
    plot_results(report, output / PLOT_FILE)
    return {**report, "table": table, "table_file": str(output / TABLE_FILE), "plot": str(output / PLOT_FILE)}


def _judge_task(experiment: ReproduceConfig, description: str, evaluations: list[Mapping[str, Any]]
                ) -> dict[str, Any]:
    """One task's arms and findings, with its test set's size and the per-block diagnostic."""
    correct = _stacked(experiment, evaluations)
    return {"description": description, **judge(correct, experiment.bootstrap_resamples),
            "test_examples": int(next(iter(correct.values())).shape[1]), "blocks": _block_means(evaluations)}


def _stacked(experiment: ReproduceConfig, evaluations: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """``{arm: [S, N] booleans}`` in the order of ``experiment.seeds`` (the raw pixels' one row repeated)."""
    by_seed = {e["seed"]: np.load(e["correct"]) for e in evaluations}
    missing = [seed for seed in (*experiment.seeds, None) if seed not in by_seed]
    if missing:
        raise ValueError(f"no evaluation of seeds {missing} (None: the raw pixels)")
    return {arm: np.stack([by_seed[None if arm == "raw-pixels" else seed][arm] for seed in experiment.seeds])
            for arm in experiment.arms}


def _block_means(evaluations: list[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Each encoder arm's per-block probe top-1, averaged over seeds (``{}`` without block probes)."""
    per_arm: dict[str, list[list[float]]] = {}
    for evaluation in evaluations:
        for arm, result in evaluation["arms"].items():
            if "blocks_top1" in result:
                per_arm.setdefault(arm, []).append(result["blocks_top1"])
    return {arm: np.mean(rows, axis=0).tolist() for arm, rows in per_arm.items()}


def markdown_table(experiment: ReproduceConfig, report: Mapping[str, Any]) -> str:
    """Which tasks chose and which score, the recipe, each arm's compute and every verdict; then per task the arms (mean ±
    95 % CI, per seed, difference to random init), the findings and their verdicts; the private runs' privacy."""
    lines = [report["split"], "", _recipe_line(report["recipe"]), "", _compute_line(report["compute"]), "",
             *_verdicts_table(report["tasks"])]
    for task in report["tasks"].values():
        lines += ["", f"### {task['description']}", "", *_task_table(task, report["seeds"])]
    lines += ["", *(_privacy_line(entry) for entry in report["privacy"])]
    return "\n".join(lines)


def _recipe_line(recipe: Mapping[str, Any]) -> str:
    if not recipe:
        return "vip-recipe: no overrides (the faithful recipe; finding 4 compares it with itself on other private sets)"
    return "vip-recipe: " + ", ".join(f"{key} = {value!r}" for key, value in recipe.items())


def _compute_line(compute: Mapping[str, int]) -> str:
    """Each trained arm's FLOPs and the recipe's DP stage against the faithful arm's."""
    trained = ", ".join(f"{arm} {flops:.3g}" for arm, flops in compute.items() if flops)
    return ("Training compute (FLOPs, forward + backward per image x images seen, every stage an arm trained): "
            f"{trained}; vip-recipe / dp-from-synthetic = {compute['vip-recipe'] / compute['dp-from-synthetic']:.3f}")


def _verdicts_table(tasks: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every finding's difference, interval and verdict, one column per task."""
    columns = list(tasks.values())
    lines = ["| # | finding (A - B > margin) | " + " | ".join(task["description"] for task in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for index, finding in enumerate(columns[0]["findings"]):
        cells = []
        for task in columns:
            judged = task["findings"][index]
            d = judged["difference"]
            cells.append(f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] **{judged['verdict']}**")
        lines.append(f"| {finding['number']} | {finding['arm']} - {finding['baseline']} > {finding['margin']:+.2f} | "
                     + " | ".join(cells) + " |")
    return lines


def _task_table(task: Mapping[str, Any], seeds: list[int]) -> list[str]:
    arms, base = task["arms"], task["arms"]["random-init"]["mean"]
    lines = [f"Downstream top-1 (converged linear probe on pooled tokens of all blocks; {task['test_examples']} "
             f"test images, seeds {', '.join(map(str, seeds))}; 95 % CI: paired bootstrap over test "
             "images, seeds averaged)", "",
             "| arm | top-1 | 95 % CI | per seed | vs random init |", "|---|---:|---:|---:|---:|"]
    for arm, value in arms.items():
        per_seed = " / ".join(f"{v:.3f}" for v in value["per_seed"])
        lines.append(f"| {arm} | {value['mean']:.3f} | [{value['low']:.3f}, {value['high']:.3f}] | {per_seed} | "
                     f"{value['mean'] - base:+.3f} |")
    lines += ["", "| # | finding (fixed before running) | difference | 95 % CI | margin | verdict |",
              "|---|---|---:|---:|---:|---|"]
    for finding in task["findings"]:
        d = finding["difference"]
        lines.append(f"| {finding['number']} | {finding['claim']} ({finding['arm']} - {finding['baseline']}) | "
                     f"{d['mean']:+.3f} | [{d['low']:+.3f}, {d['high']:+.3f}] | {finding['margin']:+.2f} | "
                     f"**{finding['verdict']}** |")
    return lines + _blocks_table(task)


def _blocks_table(task: Mapping[str, Any]) -> list[str]:
    """The per-block diagnostic: each encoder arm's probe on every block alone beside all blocks together."""
    blocks = task.get("blocks") or {}
    if not blocks:
        return []
    depth = len(next(iter(blocks.values())))
    lines = ["", "Diagnostic, decided by no finding: the same probe on each encoder block's pooled tokens alone "
             "(top-1, mean over seeds)", "",
             "| arm | " + " | ".join(f"block {k + 1}" for k in range(depth)) + " | all blocks |",
             "|---|" + "---:|" * (depth + 1)]
    for arm, values in blocks.items():
        cells = " | ".join(f"{v:.3f}" for v in values)
        lines.append(f"| {arm} | {cells} | {task['arms'][arm]['mean']:.3f} |")
    return lines


def _privacy_line(entry: Mapping[str, Any]) -> str:
    if entry.get("epsilon") is None:
        return (f"- {entry['arm']}, seed {entry['seed']}: no DP ({entry['steps']} steps on its own "
                f"{entry['dataset_size']:,} private images; its set's ledger charged ε = ∞)")
    return (f"- {entry['arm']}, seed {entry['seed']}: ε = {entry['epsilon']:.3f} (δ = {entry['delta']:.1e}, "
            f"σ = {entry['noise_multiplier']:.3f}, q = {entry['sample_rate']:.4f}, {entry['steps']} steps) on its own "
            f"{entry['dataset_size']:,} private images")


def plot_results(report: Mapping[str, Any], path: str | Path) -> Path:
    """Two panels per task: each arm's top-1 with its CI and seeds; each finding's difference with its CI and
    margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report["tasks"].values())
    figure, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.6 * len(tasks)), squeeze=False,
                                gridspec_kw={"width_ratios": [3, 2]})
    for (left, right), task in zip(axes, tasks):
        _plot_arms(left, task["arms"])
        _plot_findings(right, task["findings"])
        left.set_title(task["description"], loc="left", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return Path(path)


def _plot_arms(axis, arms: Mapping[str, Any]) -> None:
    names = list(arms)
    for row, name in enumerate(names):
        value = arms[name]
        axis.errorbar(value["mean"], row, xerr=[[value["mean"] - value["low"]], [value["high"] - value["mean"]]],
                      fmt="o", color="C0", capsize=3)
        axis.scatter(value["per_seed"], [row] * len(value["per_seed"]), marker="x", color="C1", zorder=3)
    axis.set_yticks(range(len(names)), names)
    axis.invert_yaxis()
    axis.set_xlabel("downstream top-1 (o: mean, 95 % CI; x: seeds)")


def _plot_findings(axis, findings: list[Mapping[str, Any]]) -> None:
    for row, finding in enumerate(findings):
        d = finding["difference"]
        axis.errorbar(d["mean"], row, xerr=[[d["mean"] - d["low"]], [d["high"] - d["mean"]]], fmt="o",
                      color={"reproduced": "C2", "not reproduced": "C3"}.get(finding["verdict"], "C7"), capsize=3)
        axis.plot([finding["margin"]] * 2, [row - 0.3, row + 0.3], color="k", linewidth=1)
    axis.axvline(0, color="k", linewidth=0.5, linestyle=":")
    axis.set_yticks(range(len(findings)), [f"({f['number']}) {f['verdict']}" for f in findings])
    axis.invert_yaxis()
    axis.set_xlabel("difference of top-1 (| : margin)")
