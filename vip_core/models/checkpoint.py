"""Checkpoints: our own (``{"model", "config", ...}``) and the released MAE/ViP ``.pth`` files.

A checkpoint is ``torch.save({"model": state_dict, "config": VipConfig JSON dict, **extra})``; a
pre-training directory holds one as ``checkpoint.pt``. The released MAE and ViP files are
``{"model": state_dict}`` with no config, so loading one needs the model's :class:`ModelConfig`.
Files are read with ``weights_only=True``: tensors, numbers, strings and containers (and the
``argparse.Namespace`` that MAE's training script stores as ``args``), never arbitrary objects.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vip_core.atomic import atomic_path
from vip_core.config import ModelConfig, VipConfig, validate_config
from vip_core.models.mae import GlobalPool, MaskedAutoencoderViT, build_encoder, build_mae, export_encoder

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
# What a published checkpoint holds, and nothing else: the weights, the run's config, its step, its privacy
# ledger (ε, δ, σ, q, steps, accountant) and the moving average of the weights (None without ``ema_decay``: it is
# computed from the released weights alone). Training checkpoints hold more (optimiser, random streams, plan), stay
# with the run and are as private as the data.
PUBLISHED_ENTRIES = ("model", "config", "step", "ledger", "ema")
WEIGHT_ENTRIES = ("model", "ema")  # the published entries that are state dicts
_ENTRY_OF_WEIGHTS = {"final": "model", "ema": "ema"}  # evaluation.encoder_weights -> the entry loaded
_SHOWN_KEYS = 8


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not fit the model; the message names the file and keys."""


def checkpoint_file(path: str | os.PathLike[str]) -> Path:
    """``path`` itself, or ``path/checkpoint.pt`` when ``path`` is a directory."""
    path = Path(path)
    return path / CHECKPOINT_FILE if path.is_dir() else path


def save_checkpoint(path: str | os.PathLike[str], *, model: nn.Module, config: VipConfig, **extra: Any) -> Path:
    """Writes ``{"model": state_dict, "config": config JSON dict, **extra}`` atomically.

    The file appears whole or not at all: it is written next to the target and renamed over it.

    Args:
        path: the file, or a directory to hold ``checkpoint.pt``.
        model: the model; a wrapper with ``.module`` or ``._module`` (DDP, Opacus) is unwrapped so
            the keys are the bare model's.
        config: the run's configuration.
        **extra: further entries (step, optimizer state, ledger, ...): tensors, numbers, strings and
            containers of them, so :func:`load_checkpoint` can read them back safely.

    Returns:
        The file written.
    """
    if not isinstance(config, VipConfig):
        raise TypeError(f"save_checkpoint: config must be a VipConfig, got {type(config).__name__}")
    target = checkpoint_file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": _unwrap(model).state_dict(), "config": config.model_dump(mode="json"), **extra}
    with atomic_path(target) as partial_file:
        torch.save(payload, partial_file)
    logger.info("saved checkpoint %s", target)
    return target


def release_payload(training_checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The published form of a training checkpoint (``model``, ``config``, ``step``, and the training step's
    ``state``: optimiser, plan, ledger; see :mod:`vip_core.train.step`): exactly ``PUBLISHED_ENTRIES``.

    The ledger is reduced to its summary (ε of the data set, δ, σ, q, steps, accountant, the other runs
    composed in); a checkpoint without privacy publishes ``ledger: None``, one without a moving average of the
    weights ``ema: None``.
    """
    from vip_core.privacy.ledger import PrivacyLedger

    ledger = training_checkpoint["state"].get("ledger")
    return {
        "model": training_checkpoint["model"],
        "config": training_checkpoint["config"],
        "step": int(training_checkpoint["step"]),
        "ledger": PrivacyLedger.from_state_dict(ledger).summary() if ledger is not None else None,
        "ema": training_checkpoint.get("ema"),
    }


def load_checkpoint(path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Reads a checkpoint file, or ``checkpoint.pt`` in a directory.

    A bare state dict (a file holding only the model's tensors) is returned as ``{"model": it}``.

    Raises:
        FileNotFoundError: nothing is there.
        CheckpointError: the file is not a checkpoint torch can read safely, or holds no model.
    """
    file = checkpoint_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint not found: {file}")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            payload = torch.load(file, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{file}: not a readable checkpoint ({reason})") from None
    if isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        payload = {"model": payload}
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), Mapping):
        found = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{file}: no 'model' state dict in the checkpoint (found {found})")
    return payload


def load_mae(path: str | os.PathLike[str], model_config: ModelConfig | None = None) -> MaskedAutoencoderViT:
    """The MAE stored in a checkpoint, on the CPU, every key matched.

    Args:
        path: our checkpoint (file or directory), or a released MAE/ViP ``.pth`` holding the full
            autoencoder (decoder included).
        model_config: the model's size; taken from the checkpoint when None, required for released files.

    Raises:
        CheckpointError: no configuration, or missing, unexpected or misshapen keys (named in the message).
    """
    payload = load_checkpoint(path)
    mae = build_mae(_model_config(payload, model_config, path))
    load_state_dict_exactly(mae, payload["model"], source=str(checkpoint_file(path)))
    return mae


def load_encoder(
    path: str | os.PathLike[str],
    model_config: ModelConfig | None = None,
    num_classes: int = 0,
    global_pool: GlobalPool = "token",
    weights: str = "final",
) -> VisionTransformer:
    """The encoder stored in a checkpoint, as a timm ``VisionTransformer`` (see :func:`export_encoder`).

    Args:
        path: a checkpoint holding a full MAE (ours or released), or a released encoder-only file
            (MAE's ``mae_pretrain_vit_*.pth``: the encoder's keys and no decoder).
        model_config: the model's size; taken from the checkpoint when None, required for released files.
        num_classes: classifier outputs; 0 gives no head. A head is freshly initialised unless the
            file holds one of the same shape.
        global_pool: ``"token"`` (class token) or ``"avg"`` (mean of the patch tokens).
        weights: ``"final"`` (the checkpoint's weights) or ``"ema"`` (their moving average, ``ema_decay`` > 0).

    Raises:
        CheckpointError: no configuration, keys that do not fit (named in the message), or no moving average.
    """
    payload = load_checkpoint(path)
    config = _model_config(payload, model_config, path)
    state = weights_entry(payload, weights, path)
    source = str(checkpoint_file(path))
    if "decoder_embed.weight" in state:
        mae = build_mae(config)
        load_state_dict_exactly(mae, state, source=source)
        return export_encoder(mae, num_classes=num_classes, global_pool=global_pool)
    vit = build_encoder(config, num_classes=num_classes, global_pool=global_pool)
    load_state_dict_exactly(vit, state, source=source, optional_prefixes=("head.",))
    return vit


def weights_entry(payload: Mapping[str, Any], weights: str, path: str | os.PathLike[str]) -> Mapping[str, torch.Tensor]:
    """The state dict ``weights`` (``"final"`` or ``"ema"``) of a loaded checkpoint.

    Raises:
        CheckpointError: an unknown choice, or ``"ema"`` from a checkpoint without a moving average.
    """
    if weights not in _ENTRY_OF_WEIGHTS:
        raise CheckpointError(f"encoder_weights: unknown choice {weights!r} (known: {', '.join(_ENTRY_OF_WEIGHTS)})")
    state = payload.get(_ENTRY_OF_WEIGHTS[weights])
    if state is None:
        raise CheckpointError(f"{checkpoint_file(path)} holds no EMA weights (train with ema_decay > 0) to load "
                              "for encoder_weights: ema")
    return state


def load_state_dict_exactly(
    module: nn.Module,
    state: Mapping[str, torch.Tensor],
    *,
    source: str,
    optional_prefixes: tuple[str, ...] = (),
) -> None:
    """Loads ``state`` into ``module`` only if every key matches in name and shape.

    Args:
        module: the model to fill.
        state: the state dict to load.
        source: where ``state`` came from, for the error message.
        optional_prefixes: keys of ``module`` under these prefixes may be absent from ``state``
            (they keep their initial values).

    Raises:
        CheckpointError: naming the missing, unexpected and misshapen keys.
    """
    expected = module.state_dict()
    missing = sorted(k for k in expected.keys() - state.keys() if not k.startswith(optional_prefixes))
    unexpected = sorted(state.keys() - expected.keys())
    misshapen = sorted(
        f"{key} {tuple(state[key].shape)} vs model {tuple(expected[key].shape)}"
        for key in expected.keys() & state.keys()
        if tuple(state[key].shape) != tuple(expected[key].shape)
    )
    problems = [
        f"{label}: {_summarise(keys)}"
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", misshapen))
        if keys
    ]
    if problems:
        raise CheckpointError(f"{source} does not fit the model: {'; '.join(problems)}")
    module.load_state_dict(dict(state), strict=not optional_prefixes)


def _model_config(payload: Mapping[str, Any], model_config: ModelConfig | None, path: str | os.PathLike[str]) -> ModelConfig:
    if model_config is not None:
        return model_config
    if "config" not in payload:
        raise CheckpointError(
            f"{checkpoint_file(path)} holds no config (a released MAE/ViP .pth?): pass model_config"
        )
    return validate_config(payload["config"]).model


def _summarise(keys: Iterable[str]) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown if len(keys) <= _SHOWN_KEYS else f"{shown} and {len(keys) - _SHOWN_KEYS} more"


def _unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DDP (``.module``) and Opacus (``._module``) wrappers."""
    for attribute in ("module", "_module"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module):
            return _unwrap(inner)
    return model
