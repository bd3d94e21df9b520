"""megatron_pp: Megatron-style pretraining built around memory-efficient pipeline schedules."""

__version__ = "0.1.0"
