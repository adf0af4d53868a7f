"""``trainer_setup_hook`` of the megatron trainer tests: applies tests/megatron/_cpu_megatron.py's
CUDA->CPU patches of megatron-core for the life of the rank actor process (test-only; library
code never patches megatron)."""
from __future__ import annotations

_ACTIVE = None


def apply() -> None:
    global _ACTIVE
    if _ACTIVE is None:
        from tests.megatron._cpu_megatron import cpu_patches
        _ACTIVE = cpu_patches()
        _ACTIVE.__enter__()


HOOK = "tests.launch._megatron_cpu:apply"
