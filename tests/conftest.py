"""Shared pytest set-up."""
import os

# Tests run several ranks in one process on one GPU, each rank with two streams (the
# GPU-direct side stream) whose kernels spin until the other ranks' streams make progress.
# With CUDA's default of 8 hardware queues, streams share queues, and a spinning kernel can
# hold back a launch queued behind it on another stream. Set before CUDA starts.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
