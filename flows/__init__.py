"""Prefect flows: the end-to-end pipeline (``vip-pipeline``) and one flow per make target, composing the stages
of ``tasks/`` through one :class:`flows.graph.StageGraph`. No torch here; ``flows/app`` is the application above."""
