"""Data planes: the code that copies into the send regions, publishes pieces, waits on
flags, reduces in rank order and copies results out. ``cpu`` is the CPU twin of the GPU
kernels (same steps, same bits)."""
from .cpu import CpuDataPlane

__all__ = ["CpuDataPlane"]
