"""streamfuse runtime layer (see ARCHITECTURE.md in the docs)."""
