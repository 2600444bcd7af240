"""Exporting a checkpoint's weights for use outside vip, with a model card that carries its privacy ledger.

Three formats, all read with no renaming of keys:

* ``timm``: the encoder's state dict (``torch.save``), which ``timm.create_model(..., pretrained=True,
  pretrained_cfg_overlay=dict(file=F, num_classes=0), num_classes=0, **kwargs)`` loads strictly;
* ``safetensors``: the same state dict as a ``.safetensors`` file, which timm loads the same way;
* ``mae``: ``{"model": the whole autoencoder's state dict}``, the layout of facebookresearch/mae's checkpoints:
  ``models_mae`` loads it strictly, and its fine-tuning and linear-probe scripts load the encoder from it.

The model card (``F``'s stem + ``.json`` and ``.md``) names the architecture and the exact ``timm.create_model``
call, and the checkpoint's ledger (ε, δ, σ, q, steps, accountant) with the adjacency and the values its guarantee
covers. It never names the data set's fingerprint: a digest of the private data stays with the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import safetensors.torch
import timm
import torch

from vip_core.atomic import atomic_path, write_json, write_text
from vip_core.config import EXPORT_FORMATS, ModelConfig, VipConfig, validate_config
from vip_core.models.checkpoint import CheckpointError, checkpoint_file, load_checkpoint, release_payload, weights_entry
from vip_core.models.mae import encoder_state_dict
from vip_core.privacy.ledger import ADJACENCY
from vip_core.train.data import IMAGENET_MEAN, IMAGENET_STD

# timm's ViT families by (width, depth, heads); a model of another size is built from the base family's factory
# with every size given as a keyword.
TIMM_VIT_FAMILIES = {(192, 12, 3): "tiny", (384, 12, 6): "small", (768, 12, 12): "base", (1024, 24, 16): "large",
                     (1280, 32, 16): "huge"}
GENERIC_TIMM_MODEL = "vit_base_patch16_224"
COVERS = ("the weights in this file: released from the checkpoint's allow-list (weights, config, step, ledger), "
          "all of them trained by the differentially private mechanism; anything computed from them alone "
          "(features, evaluations on public data) is post-processing and covered as well")
NOT_COVERED = ("values computed from the private data without noise: the per-step loss and images/s of the "
               "private stage when privacy.log_private_statistics was on, timings, the data set's fingerprint "
               "(withheld here), and the training checkpoints under the run's ray/ folder (docs/privacy.md lists "
               "each); N, q = B/N and delta are published, which zero-out adjacency allows")
ADJACENCY_MEANING = ("zero-out: two data sets are neighbours when one sample of one is replaced by a null sample that "
                     "contributes nothing to training; both have the same size N")
WEIGHTS_MEANING = {"final": "its final weights", "ema": "the moving average of its weights, post-processing of the "
                   "weights released at every step"}
FINGERPRINT_WITHHELD = ("withheld: the fingerprint is a digest of the private data set's layout and bytes; it stays "
                        "in the run's plan.json and names the set's ledger")


def export_checkpoint(checkpoint: str | os.PathLike[str], fmt: str, output: str | os.PathLike[str],
                      weights: str = "final") -> dict[str, Any]:
    """Writes the checkpoint's weights to ``output`` in ``fmt`` and its model card beside it.

    Args:
        checkpoint: a vip checkpoint (file, or a folder holding ``checkpoint.pt``): a published one, or a
            training checkpoint, which is reduced to the published entries first.
        fmt: ``timm``, ``mae`` or ``safetensors``.
        output: the weights file; the card is written as its stem + ``.json`` and ``.md``. None of the three
            may exist yet.
        weights: ``"final"`` (the checkpoint's weights) or ``"ema"`` (their moving average, ``ema_decay`` > 0).

    Returns:
        The paths written (``output``, ``card_json``, ``card_markdown``) and the card.

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError: not a vip checkpoint.
        ValueError: an unknown format or file ending, or an output that exists.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format: unknown format {fmt!r} (known: {', '.join(EXPORT_FORMATS)})")
    output = Path(output)
    card_json, card_markdown = output.with_suffix(".json"), output.with_suffix(".md")
    _check_output(output, fmt, (card_json, card_markdown))
    release = read_release(checkpoint)
    config = validate_config(release["config"])
    state = weights_entry(release, weights, checkpoint)
    _write_weights(output, fmt, state, timm_recipe(config.model, output.name))
    card = model_card(config, release, fmt=fmt, file=output, weights=weights)
    write_json(card_json, card)
    write_text(card_markdown, card_as_markdown(card))
    return {"output": str(output), "card_json": str(card_json), "card_markdown": str(card_markdown), "card": card}


def read_release(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """The published entries of a vip checkpoint (weights, config, step, ledger summary or None).

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError: the file holds no vip config (a released MAE/ViP ``.pth``, a bare state dict).
    """
    payload = load_checkpoint(checkpoint)
    if "config" not in payload:
        raise CheckpointError(f"{checkpoint_file(checkpoint)}: not a vip checkpoint (it holds no vip config)")
    # A training checkpoint keeps its ledger in the step's state: reduced first, so its ledger is never missed.
    return release_payload(payload) if "state" in payload else payload


def timm_recipe(model: ModelConfig, file: str) -> dict[str, Any]:
    """The ``timm.create_model`` call that builds the encoder and loads ``file`` into it strictly.

    ``num_classes=0`` in the overlay as well as in the call keeps timm's load strict (timm loads leniently
    when the two differ). The class token is pooled, MAE's linear-probe protocol; ``fc_norm=False`` keeps the
    final LayerNorm where the MAE has it, so ``global_pool="avg"`` (whose default in timm moves that norm after
    the pooling, under another key) loads the same file.
    """
    family = TIMM_VIT_FAMILIES.get((model.embed_dim, model.depth, model.num_heads))
    name = f"vit_{family}_patch{model.patch_size}_{model.img_size}"
    model_name = name if family is not None and timm.is_model(name) else GENERIC_TIMM_MODEL
    overlay = {"file": file, "num_classes": 0, "input_size": (model.in_chans, model.img_size, model.img_size),
               "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    kwargs = {"img_size": model.img_size, "patch_size": model.patch_size, "in_chans": model.in_chans,
              "embed_dim": model.embed_dim, "depth": model.depth, "num_heads": model.num_heads,
              "mlp_ratio": model.mlp_ratio, "global_pool": "token", "fc_norm": False}
    arguments = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
    overlay_text = ", ".join(f"{key}={value!r}" for key, value in overlay.items())
    call = (f"timm.create_model({model_name!r}, pretrained=True, pretrained_cfg_overlay=dict({overlay_text}), "
            f"num_classes=0, {arguments})")
    return {"model_name": model_name, "pretrained_cfg_overlay": overlay, "kwargs": kwargs, "call": call}


def model_card(config: VipConfig, release: Mapping[str, Any], *, fmt: str, file: Path,
               weights: str = "final") -> dict[str, Any]:
    """The card's content: the model (``weights``: its final weights or their moving average), how to load it,
    the file's digest and the privacy ledger."""
    model = config.model
    state = _format_state(fmt, release["model"])
    return {
        "file": file.name,
        "format": fmt,
        "sha256": _sha256(file),
        "model": {
            "architecture": "ViT encoder of a masked autoencoder (MAE)" + (", decoder included" if fmt == "mae" else ""),
            "config": config.name,
            **model.model_dump(),
            "parameters": sum(tensor.numel() for tensor in state.values()),
            "training_step": int(release.get("step", 0)),
            "weights": weights,
            "normalisation": {"mean": IMAGENET_MEAN, "std": IMAGENET_STD},
        },
        "timm": timm_recipe(model, file.name) if fmt != "mae" else None,
        "data": {"fingerprint": None, "fingerprint_note": FINGERPRINT_WITHHELD},
        "privacy": _privacy_section(release.get("ledger"), config.privacy.log_private_statistics),
    }


def card_as_markdown(card: Mapping[str, Any]) -> str:
    """The card for people: what the file is, how to load it, and the guarantee or its absence."""
    model = card["model"]
    lines = [f"# {card['file']}", "",
             f"{model['architecture']}, exported by vip from the `{model['config']}` configuration at training "
             f"step {model['training_step']} ({WEIGHTS_MEANING[model['weights']]}): {model['img_size']} px images, "
             f"patch {model['patch_size']}, width {model['embed_dim']}, {model['depth']} blocks, "
             f"{model['num_heads']} heads, {model['parameters']:,} parameters. Format `{card['format']}`, sha256 `{card['sha256']}`.", "",
             f"Inputs are normalised with mean {model['normalisation']['mean']} and std {model['normalisation']['std']}.",
             "", "## Loading", ""]
    if card["timm"] is not None:
        lines += ["```python", "import timm", "", f"encoder = {card['timm']['call']}", "```", "",
                  "`fc_norm=False` keeps the encoder's final LayerNorm before pooling, as the MAE trained it; "
                  "pass `global_pool='avg'` (keeping `fc_norm=False`) for the mean of the patch tokens."]
    else:
        lines += ["`torch.load(file)['model']` is the state dict of facebookresearch/mae's `models_mae` "
                  "autoencoder (strict load); its `main_finetune.py` and `main_linprobe.py` take the file as "
                  "`--finetune` and load the encoder from it."]
    lines += ["", "## Privacy", ""]
    privacy = card["privacy"]
    if privacy is None:
        lines.append("This checkpoint carries no privacy ledger: it was trained without differential privacy, "
                     "and no privacy guarantee is made for it.")
    else:
        lines += [f"({privacy['epsilon']:.4g}, {privacy['delta']:.3g})-differential privacy of the private data "
                  f"set, accounted by `{privacy['accountant']}` for {privacy['steps']} steps of the Poisson-subsampled "
                  f"Gaussian mechanism with noise multiplier σ = {privacy['noise_multiplier']:.6g} and sampling rate "
                  f"q = {privacy['sample_rate']:.6g}"
                  + (f", composed with {len(privacy['composed_with'])} earlier run(s) on the same set."
                     if privacy["composed_with"] else "."), "",
                  f"* Adjacency: {privacy['adjacency_meaning']}.",
                  f"* Covers: {privacy['covers']}.",
                  f"* Does not cover: {privacy['not_covered']}.",
                  f"* privacy.log_private_statistics was {'on' if privacy['private_statistics_logged'] else 'off'} "
                  "in this run."]
    lines += ["", f"The data set's fingerprint is {card['data']['fingerprint_note']}.", ""]
    return "\n".join(lines)


def _privacy_section(ledger: Mapping[str, Any] | None, statistics_logged: bool) -> dict[str, Any] | None:
    """The ledger's values, the adjacency they hold under, and what they cover; None without a ledger."""
    if ledger is None:
        return None
    keys = ("epsilon", "delta", "noise_multiplier", "sample_rate", "steps", "accountant", "composed_with")
    return {**{key: ledger[key] for key in keys}, "adjacency": ADJACENCY, "adjacency_meaning": ADJACENCY_MEANING,
            "covers": COVERS, "not_covered": NOT_COVERED, "private_statistics_logged": statistics_logged}


def _format_state(fmt: str, mae_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole autoencoder for ``mae``; the encoder, whose keys are timm's, for the others."""
    return dict(mae_state) if fmt == "mae" else encoder_state_dict(dict(mae_state))


def _write_weights(output: Path, fmt: str, mae_state: Mapping[str, torch.Tensor], recipe: Mapping[str, Any]) -> None:
    state = {key: tensor.contiguous() for key, tensor in _format_state(fmt, mae_state).items()}
    with atomic_path(output) as partial_file:
        if fmt == "safetensors":
            metadata = {"format": "pt", "timm_model_name": recipe["model_name"], "timm_kwargs": json.dumps(recipe["kwargs"])}
            safetensors.torch.save_file(state, str(partial_file), metadata=metadata)
        else:
            torch.save({"model": state} if fmt == "mae" else state, partial_file)


def _check_output(output: Path, fmt: str, cards: tuple[Path, Path]) -> None:
    """timm reads a file as safetensors by its ending, so the ending must match the format; nothing is overwritten."""
    if (output.suffix == ".safetensors") != (fmt == "safetensors"):
        raise ValueError(f"--output {output}: the {fmt} format needs a file name "
                         f"{'ending in' if fmt == 'safetensors' else 'not ending in'} .safetensors")
    if output.suffix in (".json", ".md"):
        raise ValueError(f"--output {output}: the model card takes the .json and .md names; choose another ending")
    existing = [str(path) for path in (output, *cards) if path.exists()]
    if existing:
        raise ValueError(f"{', '.join(existing)} exists: choose another --output or remove it")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
