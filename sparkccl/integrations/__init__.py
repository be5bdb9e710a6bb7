"""Integrations: sparkccl behind other stacks' collectives (docs/VLLM_SGLANG.md)."""
