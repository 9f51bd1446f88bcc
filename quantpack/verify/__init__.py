"""``verify()``: what a packed checkpoint cost, and whether its files can be trusted.

A report in four sections, each building on the one before:

* **integrity**: the checks :func:`quantpack.load` runs (:mod:`quantpack.checkpoint.integrity`, one verdict for every
  folder), every problem reported: ``config.json`` and its ``quantization_config`` (layout version, scheme), the
  manifest ``quantpack.json`` (its files, layers and per-tensor sha256s), the shard index against the
  shard headers, every tensor's shape and dtype against the model the config describes, and every
  floating-point value finite. For manifests written before per-tensor digests, a file whose checksum differs
  is searched for the tensors that changed by comparing with the reference weights when there is a reference.
* **layers**: each quantized layer dequantized and compared with the reference weight
  (relative Frobenius error), worst layers first.
* **kernels**: for each distinct quantized layer layout, the module's forward on the device (the
  fused Triton kernel on a GPU, the reference path on the CPU) on random inputs against its
  scheme's float32 oracle (a float32 matmul with the dequantized weight; for W8A8 the exact
  result on the same int8 values).
* **end_to_end**: the packed and the reference model on the same text: for causal LMs the
  perplexity of both, mean and 99th-percentile KL divergence of the next-token distributions and
  top-1 agreement; for encoders the cosine similarity of mean-pooled embeddings.

One module per section (:mod:`.integrity`, :mod:`.layers`, :mod:`.kernels`, :mod:`.end_to_end`), the report and
its schema in :mod:`.report`, :func:`verify` itself in :mod:`.run`.

Thresholds turn numbers into a verdict: ``pass`` (exit code 0), ``fail`` (a check failed: 1) or
``corrupt`` (problems in the files: 2). docs/verify.md documents the JSON schema
(:data:`REPORT_SCHEMA`).

Each scheme's :class:`~quantpack.schemes.ModuleCheck` (see :mod:`quantpack.schemes`) says how to dequantize its
modules, what float32 result their forward must match, with what tolerance, and (optionally) how to find which of
their stored tensors changed.
"""
from .end_to_end import compare_causal_lm, compare_encoder
from .integrity import check_integrity, quantized_modules
from .kernels import kernel_errors
from .layers import layer_errors
from .report import (CONFIDENT_MARGIN, DEFAULT_CONTEXT_LENGTH, DEFAULT_MAX_KL, DEFAULT_MAX_TOKENS, DEFAULT_MIN_COSINE,
                     DEFAULT_MIN_TOP1, DEFAULT_TEXT, MIN_CONFIDENT_POSITIONS, PROBLEM_KINDS, REPORT_SCHEMA,
                     SCHEMA_VERSION, Check, Problem, VerifyReport)
from .run import verify

__all__ = ["verify", "VerifyReport", "Check", "Problem", "REPORT_SCHEMA", "SCHEMA_VERSION", "PROBLEM_KINDS",
           "DEFAULT_TEXT", "DEFAULT_MAX_KL", "DEFAULT_MIN_TOP1", "DEFAULT_MIN_COSINE", "DEFAULT_CONTEXT_LENGTH",
           "DEFAULT_MAX_TOKENS", "CONFIDENT_MARGIN", "MIN_CONFIDENT_POSITIONS", "check_integrity", "layer_errors",
           "kernel_errors", "compare_causal_lm", "compare_encoder", "quantized_modules"]
