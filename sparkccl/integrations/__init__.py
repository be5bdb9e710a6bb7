"""Integrations: sparkccl behind other stacks' collectives: torch.distributed (docs/TORCH.md),
vLLM and SGLang (docs/VLLM_SGLANG.md)."""
