"""Test factories shared by the platform and engine LoRA tests (tiny base models, real PEFT adapters,
hand-built safetensors files)."""
