"""LoRA adapters. ``format`` is torch-free: the control plane imports it to validate uploads."""
from loraplex.engine.lora.format import (
    AdapterFormatError,
    AdapterSpec,
    LoraConfig,
    LoraModule,
    SafetensorsHeader,
    TensorInfo,
    check_adapter,
    parse_adapter_config,
    read_safetensors_header,
)

__all__ = ["AdapterFormatError", "AdapterSpec", "LoraConfig", "LoraModule", "SafetensorsHeader", "TensorInfo",
           "check_adapter", "parse_adapter_config", "read_safetensors_header"]
