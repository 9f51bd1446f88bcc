"""``convert()``: turn a Hugging Face checkpoint into a packed quantpack checkpoint, streaming.

The conversion never holds the model: it reads one source tensor at a time, quantizes it (on a GPU
when there is one), and writes one output shard at a time, so peak memory is about the largest
tensor plus one output shard. Which tensors are quantized comes from the model's own structure
(its transformers class built on the meta device: the ``nn.Linear`` modules), not from names.

Crash safety: the output is built in ``<parent>/.<name>.qp-partial`` and renamed when complete; the
manifest is written last. ``progress.json`` there records each finished shard's sha256 (and its
tensors' digests), so a re-run with the same source and settings re-checks those shards and resumes
after them, producing a byte-identical result. See docs/format.md for everything written.

Modules: :mod:`.options` (the arguments), :mod:`.plan` (what is quantized, under which names, in which units),
:mod:`.writer` (the shards), :mod:`.output` (lock, resume, manifest, publishing), :mod:`.summary` (the result),
:mod:`.run` (:func:`convert` itself).
"""
from .options import DEFAULT_BITS, DEFAULT_GROUP_SIZE, DEFAULT_METHOD, default_output_name, resolve_scheme
from .run import convert
from .summary import ConvertSummary, LayerResult, format_size

__all__ = ["convert", "ConvertSummary", "LayerResult", "resolve_scheme", "default_output_name", "format_size",
           "DEFAULT_BITS", "DEFAULT_GROUP_SIZE", "DEFAULT_METHOD"]
