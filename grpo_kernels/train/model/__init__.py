"""The model a run trains: loading HF checkpoints and writing them (hf), the known models (known), the length limits
(lengths), the converters applied after loading (converters), activation memory (activation) and FSDP2 sharding with
the process layout (fsdp)."""
