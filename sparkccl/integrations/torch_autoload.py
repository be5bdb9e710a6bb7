"""The ``torch.backends`` entry point: ``import torch`` calls :func:`autoload`, which registers
the torch.distributed backend ``"sparkccl"`` (docs/TORCH.md), so an unmodified script can say
``dist.init_process_group("sparkccl")``. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns all such
hooks off.

It runs inside ``import torch``, where any exception becomes a failed ``import torch``: so
this module imports nothing at load time, and :func:`autoload` never raises.
"""


def autoload() -> None:
    try:
        from . import torch_backend
        torch_backend.register()
    except Exception as e:  # noqa: BLE001 - never break `import torch`
        import warnings
        warnings.warn(f"sparkccl: the torch.distributed backend 'sparkccl' is not registered: "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
