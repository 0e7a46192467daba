"""The installed ``torch`` and ``torchvision`` checked as a pair once, before a command builds anything.

A ``torchvision`` wheel built for another ``torch`` than the installed one fails at import with
``operator torchvision::nms does not exist`` (its compiled operators do not register), which reads like a bug of
whatever imported it. :func:`check_torch_pair` says instead, in one line, which versions are installed, why they
do not work together, and the command that installs a matching pair.
"""

from __future__ import annotations

from importlib import metadata

from lightning_dfl.errors import ConfigurationError

__all__ = ["check_torch_pair", "mismatch_message", "stack_versions"]

#: the libraries whose versions ``lightning-dfl --version`` prints (read from their metadata, nothing imported)
STACK = ("torch", "torchvision", "lightning", "torchmetrics", "jsonargparse")

#: what installs a matching pair (the CPU builds; without the index URL, pip's default CUDA builds also match)
FIX = ("pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cpu "
       "(or without --index-url for the default builds)")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def stack_versions() -> str:
    """The installed versions of :data:`STACK` and Python in one line (``lightning-dfl --version``'s second), read
    from the packages' metadata without importing them, so it answers where torch itself fails to import."""
    import platform

    return ", ".join([*(f"{p} {_version(p)}" for p in STACK), f"python {platform.python_version()}"])


def mismatch_message(err: BaseException) -> str | None:
    """The one line for an import error of a mismatched pair (``None``: ``err`` is something else)."""
    text = str(err)
    if "torchvision::" not in text and "torchvision.ops" not in text:
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return (f"torchvision {_version('torchvision')} cannot load against the installed torch {_version('torch')} "
            f"({first}): one of the two wheels was built for another version of the other; install a matching "
            f"pair: {FIX}")


def check_torch_pair() -> None:
    """Import ``torchvision`` (which imports ``torch``) and refuse a mismatched pair with
    :func:`mismatch_message` (a :class:`~lightning_dfl.errors.ConfigurationError`)."""
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, ImportError, AttributeError) as err:
        message = mismatch_message(err)
        if message is None:
            raise
        raise ConfigurationError(message) from None
