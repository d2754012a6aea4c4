"""Scheduling: kernel DAG -> CUDA streams, events and priorities (pure functions, no CUDA)."""
