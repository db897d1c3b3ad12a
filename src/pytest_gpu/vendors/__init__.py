"""What each vendor's GPUs and drivers are: NVIDIA (NVML), AMD (amdsmi, ROCm's variables) and
Intel (Level Zero Sysman, ZE_AFFINITY_MASK), one interface for all three."""
