"""Simulation: predicted GPU timelines on machines without a GPU (labelled "predicted")."""
