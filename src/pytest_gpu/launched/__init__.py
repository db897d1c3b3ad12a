"""Whole pytest sessions under a launcher (torchrun / srun / mpirun), and sharding over nodes."""
