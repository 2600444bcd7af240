"""Downstream evaluation of a pre-trained encoder: linear probe, fine-tuning (optionally DP), few-shot,
COCO detection and ADE20K segmentation.

Each job takes a timm ``VisionTransformer`` (the exported MAE encoder) and public evaluation data on
disk, trains what the protocol trains and returns a small dict of metrics. Evaluation data is public:
the privacy guarantee of pre-training covers the pre-training data only. DP fine-tuning
(:mod:`vip_core.eval.finetune`) gives a separate guarantee for the fine-tuning data.
"""
