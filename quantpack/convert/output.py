"""The output directory: the lock per output, the partial directory and its progress record (resume), and
publishing the finished conversion in place of an earlier quantpack output."""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import torch

from .. import __version__
from ..format import LAYOUT_VERSION
from ..checkpoint import MANIFEST_NAME, MANIFEST_VERSION, CheckpointError, SourceCheckpoint, read_manifest, sha256_file
from ..checkpoint.writer import write_json

PARTIAL_SUFFIX = ".qp-partial"
LOCK_SUFFIX = ".qp-lock"
PROGRESS_NAME = "progress.json"
logger = logging.getLogger(__name__)


def conversion_fingerprint(resolved, src: SourceCheckpoint, settings: dict, dev: torch.device, names: list[str]) -> str:
    """What a resumed run must share with the interrupted one: quantpack version, settings, device
    kind, the shard plan, and the source weight files' names, sizes and modification times."""
    files = []
    for rel in src.weight_files:
        st = (resolved.path / rel).stat()
        files.append([rel, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"version": __version__, "settings": settings, "device": dev.type, "shards": names,
                       "files": files, "source": resolved.repo, "revision": resolved.revision}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def resume_state(partial: Path, fingerprint: str, names: list[str], settings: dict) -> dict:
    """Finished shards of an interrupted run with the same fingerprint, re-hashed; anything else in
    the partial directory is discarded (after saying so, when it is finished work made otherwise)."""
    progress_file = partial / PROGRESS_NAME
    done = {}
    try:
        state = json.loads(progress_file.read_text()) if progress_file.exists() else {}
    except ValueError:
        state = {}
    if not isinstance(state, dict):
        state = {}
    if state.get("fingerprint") == fingerprint:
        for name, entry in state.get("shards", {}).items():
            f = partial / name
            # A shard without its tensors' digests (progress written before they existed) is redone.
            if (name in names and isinstance(entry.get("tensors"), dict) and f.is_file()
                    and f.stat().st_size == entry["size"] and sha256_file(f) == entry["sha256"]):
                done[name] = entry
    elif state.get("shards"):
        before = state.get("settings")
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k)) \
            if isinstance(before, dict) else []
        what = (", ".join(f"{k} {before.get(k)!r} -> {settings.get(k)!r}" for k in changed) if changed
                else "other settings, source files or quantpack version")
        logger.warning(f"discarding the earlier partial conversion in {partial} ({len(state['shards'])} finished "
                       f"shard(s)), made with {'other settings: ' if changed else ''}{what}")
    for f in partial.iterdir():
        if f.name not in done and f.name != PROGRESS_NAME:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    return done


def make_partial(partial: Path) -> bool:
    """Create the partial directory, or take the one an interrupted run left; whether it was created.
    Anything else at that path (a link, a file) is refused: resuming deletes what it holds."""
    try:
        os.mkdir(partial)
        return True
    except FileExistsError:
        pass
    st = os.lstat(partial)
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"output: {partial} is a symbolic link, not quantpack's partial output; remove it "
                              f"or choose another --output")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"output: {partial} is not a directory, not quantpack's partial output; remove it "
                              f"or choose another --output")
    return False


def write_progress(partial: Path, fingerprint: str, done: dict, settings: dict) -> None:
    write_json(partial / PROGRESS_NAME, {"fingerprint": fingerprint, "settings": settings, "shards": done})


class OutputLock:
    """An exclusive lock on converting into one output directory: ``.<name>.qp-lock`` beside it,
    holding the owner's pid. The lock is the kernel's (``flock``), so it ends with its process
    and a crashed run never blocks the next one."""

    def __init__(self, out_path: Path):
        self.out_path = out_path
        self.path = out_path.parent / f".{out_path.name}{LOCK_SUFFIX}"
        self.fd: int | None = None

    def __enter__(self):
        while True:
            try:  # never through a link planted at the lock path: it would write into the link's target
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as e:
                if os.path.islink(self.path):
                    raise CheckpointError(f"output: {self.path} is a symbolic link, not quantpack's lock; remove "
                                          f"it or choose another --output") from None
                raise CheckpointError(f"output: cannot create the lock {self.path}: {e.strerror or e}; choose a "
                                      f"writable --output") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # a device, a pipe, or a user's file hard-linked
                os.close(fd)
                raise CheckpointError(f"output: {self.path} is not quantpack's lock (not a plain file of its own); "
                                      f"remove it or choose another --output")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                raise CheckpointError(f"output: another conversion (pid {holder if holder.isdigit() else 'unknown'}) "
                                      f"is writing {self.out_path}; wait for it to finish or choose another "
                                      f"--output") from None
            try:  # the holder before us unlinks the file on release: lock the file at the path, not an old one
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        # A lock left by a killed run holds only its pid; anything else is a file quantpack did not write.
        if not re.fullmatch(rb"\d*\n?", os.pread(fd, 64, 0)):
            os.close(fd)
            raise CheckpointError(f"output: {self.path} is not quantpack's lock (it holds other data); remove it "
                                  f"or choose another --output")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc):
        try:
            self.path.unlink(missing_ok=True)  # still held: a waiter's inode check sees it gone
        finally:
            os.close(self.fd)
            self.fd = None


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_quantpack_output(path: Path) -> bool:
    """Whether ``path`` is a finished quantpack output: its manifest says so and lists the files it wrote."""
    return written_files(path) is not None


def written_files(path: Path) -> set[str] | None:
    """The files a finished quantpack output at ``path`` lists as written (its manifest among them),
    or None when ``path`` holds no such manifest."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    if not (isinstance(manifest, dict) and "manifest_version" in manifest and "quantpack_version" in manifest):
        return None
    outputs = manifest.get("files", {}).get("outputs") if isinstance(manifest.get("files"), dict) else None
    if not isinstance(outputs, dict) or not outputs:
        return None
    return {str(rel) for rel in outputs} | {MANIFEST_NAME}


def foreign_files(path: Path, written: set[str]) -> list[str]:
    """What under ``path`` quantpack did not write: files and links not in ``written``, and folders
    holding none of them (relative paths, sorted)."""
    holders = {str(Path(rel).parent) for rel in written}
    holders |= {str(p) for rel in holders for p in Path(rel).parents}
    found = []
    for root, dirs, files in os.walk(path):  # links are listed, never followed
        base = Path(root).relative_to(path)
        for name in files:
            rel = str(base / name)
            if rel not in written or os.path.islink(path / rel):
                found.append(rel)
        for name in list(dirs):
            rel = str(base / name)
            if rel not in holders or os.path.islink(path / rel):
                found.append(rel + ("" if os.path.islink(path / rel) else "/"))
                dirs.remove(name)
    return sorted(found)


def check_output_name(out_path: Path, given: bool) -> None:
    """Refuse an output name the file system cannot hold beside its partial directory's name
    (``.<name>.qp-partial``), before anything is built."""
    limit = 255 - len(f".{PARTIAL_SUFFIX}")  # NAME_MAX of common file systems, in bytes
    size = len(out_path.name.encode())
    if size > limit:
        what = "--output" if given else "the default output name (from the source's name)"
        raise CheckpointError(f"output: {what} {out_path.name[:40]}... is {size} bytes, more than the {limit} a file "
                              f"name may have here; pass a shorter --output")


def check_replaceable_output(out_path: Path, source: Path, overwrite: bool) -> None:
    """Refuse an existing ``out_path`` that a conversion may not replace (one-line CheckpointError).

    An empty directory is used as is; a finished quantpack output is replaced only with ``overwrite``;
    anything else (a file, a symbolic link, a folder quantpack did not write, the current directory or
    one above it, the source or a folder holding it) is never replaced: replacing deletes it.
    """
    if not out_path.exists() and not out_path.is_symlink():
        return
    real = out_path.resolve()
    if out_path.is_symlink():
        raise CheckpointError(f"output: {out_path} is a symbolic link (to {real}); pass a directory path, or "
                              f"choose another --output")
    if not out_path.is_dir():
        raise CheckpointError(f"output: {out_path} is a file, not a directory; choose another --output")
    cwd = Path.cwd().resolve()
    source = Path(source).resolve()
    if real == cwd or cwd.is_relative_to(real):
        what = "is the current directory" if real == cwd else "contains the current directory"
        raise CheckpointError(f"output: {out_path} {what}, which quantpack never replaces; choose another --output")
    if real == source or source.is_relative_to(real):
        what = "is the source checkpoint" if real == source else f"contains the source checkpoint {source}"
        raise CheckpointError(f"output: {out_path} {what}, which quantpack never replaces; choose another --output")
    if not any(out_path.iterdir()):
        return
    written = written_files(out_path)
    if written is None:
        raise CheckpointError(f"output: {out_path} already exists and is not a quantpack output (no valid "
                              f"{MANIFEST_NAME}); quantpack replaces only its own outputs: choose another --output")
    others = foreign_files(out_path, written)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise CheckpointError(f"output: {out_path} holds files quantpack did not write ({shown}); move them out "
                              f"of it or choose another --output")
    if not overwrite:
        raise CheckpointError(f"output: {out_path} already exists (a finished conversion); pass --overwrite to "
                              f"replace it or choose another --output")


def publish(partial: Path, out_path: Path, source: Path, overwrite: bool) -> None:
    """Rename the finished directory into place: an existing output is checked again (something may
    have appeared while converting), then swapped out so that it survives a crash until the new one
    is in place."""
    check_replaceable_output(out_path, source, overwrite)
    if out_path.exists() and any(out_path.iterdir()):
        old = out_path.parent / f".{out_path.name}.qp-old"
        if os.path.islink(old):
            raise CheckpointError(f"output: {old} is a symbolic link; remove it or choose another --output")
        written = written_files(old) if old.is_dir() else None
        if written is not None and not foreign_files(old, written):  # left by a crash between the renames below
            shutil.rmtree(old)
        os.rename(out_path, old)
        os.rename(partial, out_path)
        shutil.rmtree(old)
    else:
        os.rename(partial, out_path)  # replaces an empty directory atomically
    fsync_dir(out_path.parent)


def make_manifest(resolved, settings: dict, dev, inputs: dict, outputs: dict, summary) -> dict:
    """The manifest ``quantpack.json`` (docs/format.md): source, settings, every input and output file's sha256
    and size, each quantized and skipped layer, totals."""
    return {
        "manifest_version": MANIFEST_VERSION, "quantpack_version": __version__,
        "layout_version": LAYOUT_VERSION,
        "source": {"repo": resolved.repo, "revision": resolved.revision, "local": resolved.local},
        "settings": {**settings, "device": dev.type},  # the device kind the codes were computed on
        "files": {"inputs": inputs, "outputs": dict(sorted(outputs.items()))},
        "layers": [{"name": layer.name, "bits": layer.bits, "group_size": layer.group_size,
                    "shape": list(layer.shape), "rel_error": layer.rel_error,
                    **({"source_transposed": True} if layer.transposed else {}),
                    **({"source": layer.source} if layer.source else {})}
                   for layer in summary.quantized],
        "skipped": [{"name": layer.name, "reason": layer.skipped} for layer in summary.skipped],
        "totals": {"source_bytes": summary.source_bytes, "output_bytes": summary.output_bytes,
                   "params_quantized": sum(layer.shape[0] * layer.shape[1] for layer in summary.quantized)},
    }
