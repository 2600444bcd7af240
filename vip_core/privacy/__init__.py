"""Differential privacy: accounting (ε from σ, q, steps, δ), the privacy plan of a run and its ledger,
Poisson sampling, per-sample clipping with Gaussian noise, and the DP optimizer.

The guarantee covers the private pre-training data only; evaluation data is public.
"""
