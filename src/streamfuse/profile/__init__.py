"""Measurement: timing on the GPU (CUDA events), later timelines and reports."""
