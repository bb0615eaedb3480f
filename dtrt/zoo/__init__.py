"""Named models: the registry table and the pairs dtrt makes on first use (the seeded tiny pairs, which train
themselves, and SmolLM2 converted from its GGUF)."""
