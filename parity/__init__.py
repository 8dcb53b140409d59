"""parity: prove a compiled distributed training job is bitwise identical to eager FSDP2."""

__version__ = "0.1.0"
