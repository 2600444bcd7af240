"""Synthetic images from procedural Shadertoy programs (Shaders21k-style): generator, renderer, mixup."""
