"""Hooks that let existing stacks (torch.distributed, vLLM, SGLang) reach sparkccl."""
