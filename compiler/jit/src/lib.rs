//! braid-jit: see ARCHITECTURE.md.
