"""streamfuse ir layer (see ARCHITECTURE.md in the docs)."""
