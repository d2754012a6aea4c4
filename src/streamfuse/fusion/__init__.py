"""streamfuse fusion layer (see ARCHITECTURE.md in the docs)."""
