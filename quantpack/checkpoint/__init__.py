"""Checkpoint I/O: the files a source checkpoint and a packed one consist of. docs/format.md is the spec.

* :mod:`.metadata`: the JSON files (``config.json`` and its ``quantization_config``, the manifest
  ``quantpack.json``) and the files' names, without torch (``quantpack info`` starts as fast as ``--help``).
* :mod:`.reading`: source and packed checkpoints' tensors, read one at a time, every header validated up front.
* :mod:`.writer`: safetensors shards streamed to disk and hashed as they are written, the index, JSON files.
* :mod:`.experts`: experts blocks stored stacked (gpt-oss, Llama 4), seen as one matrix per expert.
* :mod:`.hub`: a source or a packed checkpoint as a local directory or a hub repository.
* :mod:`.integrity`: a packed checkpoint's files and tensors against its config and manifest, one verdict for
  every reader (``quantpack.load``, transformers' ``from_pretrained``, ``quantpack verify``).

Every name of :mod:`.metadata` and :mod:`.reading` is also this package's (``checkpoint.SourceCheckpoint``); the
package itself imports neither, so importing :mod:`.metadata` alone imports no torch. Patch a name where it is
defined (``quantpack.checkpoint.reading.sha256_file``), not here.
"""
import importlib

_PARTS = ("metadata", "reading", "writer", "experts", "hub", "integrity")


def __getattr__(name: str):
    if name in _PARTS:
        return importlib.import_module(f".{name}", __name__)
    if not name.startswith("__"):
        for part in ("metadata", "reading"):  # (metadata first: it needs no torch)
            module = importlib.import_module(f".{part}", __name__)
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
