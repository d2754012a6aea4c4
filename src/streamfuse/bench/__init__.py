"""The benchmark suite of `streamfuse bench`: workloads x modes, measured side by side in one run."""
