"""One run per folder: a run locks the folder it writes while it runs, and does not write over an earlier run.

The folder a run writes (its logger's ``log_dir``, or ``default_root_dir`` without a logger: its metrics, client
rows, summary, diagnostics and ``checkpoints/last.ckpt``) is locked by process 0 before anything is written
(:class:`RunFolderLock`: an exclusive ``flock`` on ``.<folder name>.lightning-dfl.lock`` beside the folder, not in
it, so that a logger finds its folder as it left it; the operating system releases the lock when the process ends,
however it ends, so a lock file left by a killed run is simply taken over). A second
run on the same folder is refused in one line that names the folder and the process holding it.

A folder that already holds a run's files (:data:`RUN_FILES`) is not written over (:func:`check_unused`) unless
the run resumes from a checkpoint in it or the user asks for it (``overwrite=True``: the earlier run's files are
removed first, so none is left beside the new run's).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

from lightning_dfl.errors import RunFileError, writing

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock (documented)
    fcntl = None

__all__ = ["LOCK_SUFFIX", "RUN_FILES", "RunFolderLock", "check_unused", "lock_path"]

#: the end of the lock file's name, beside a running run's folder (removed when the run ends)
LOCK_SUFFIX = ".lightning-dfl.lock"
#: files of a run in its folder: one of them there means the folder holds a run
RUN_FILES = ("metrics.csv", "clients.csv", "summary.json", "hparams.yaml", "config.yaml", "checkpoints/last.ckpt")
#: folders of a run in its folder (removed with its files on overwrite)
RUN_FOLDERS = ("diagnostics",)


def check_unused(folder: str | os.PathLike, resuming_from: str | os.PathLike | None, overwrite: bool) -> None:
    """Refuse to write into ``folder`` when it holds an earlier run's files, unless the run resumes from a
    checkpoint inside it (``resuming_from``) or ``overwrite`` (the earlier files are then removed)."""
    folder = Path(folder)
    found = [name for name in RUN_FILES if (folder / name).exists()]
    if not found:
        return
    if resuming_from is not None and folder.resolve() in Path(resuming_from).resolve().parents:
        return
    if overwrite:
        with writing(folder):
            for name in found:
                (folder / name).unlink()
            for name in RUN_FOLDERS:
                if (folder / name).is_dir():
                    shutil.rmtree(folder / name)
        return
    checkpoint = folder / "checkpoints" / "last.ckpt"
    resume = f"resume it with --ckpt_path {checkpoint}, " if checkpoint.is_file() else ""
    raise RunFileError(f"the run folder {folder} already holds a run ({', '.join(found)}): {resume}choose another "
                       "folder (trainer.default_root_dir, or another logger version), or set trainer.overwrite=true "
                       "to write over it")


class RunFolderLock:
    """An exclusive lock on a run's folder, held from :meth:`acquire` to :meth:`release` (or the process's end)."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return lock_path(self.folder)

    def acquire(self, folder: str | os.PathLike) -> None:
        """Lock ``folder`` (the lock file beside it; the folder is not made), or raise :class:`~lightning_dfl.errors.RunFileError` naming the process
        that holds it. A lock file left by a killed run is taken over (its lock died with it)."""
        if fcntl is None or self._fd is not None:
            return
        self.folder = Path(folder)
        with writing(self.folder):
            self.path.parent.mkdir(parents=True, exist_ok=True)  # the folder itself is made by whoever writes it
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read(fd)
                    os.close(fd)
                    raise RunFileError(f"the run folder {self.folder} is in use by another run ({holder}): one run "
                                       "writes a folder at a time; wait for it to end, or choose another folder "
                                       "(trainer.default_root_dir, or another logger version)") from None
                try:  # the file may have been removed by the run that held it just before: lock the one in place
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            os.ftruncate(fd, 0)
            os.write(fd, f"process {os.getpid()} on {socket.gethostname()}, since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and release the lock (nothing if not held)."""
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing releases the flock
        self._fd = None


def lock_path(folder: str | os.PathLike) -> Path:
    """The lock file of a run folder: beside it, named after it."""
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


def _read(fd: int) -> str:
    """Who holds the lock, as its file says."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "its process wrote nothing yet"
