"""streamfuse codegen layer (see ARCHITECTURE.md in the docs)."""
