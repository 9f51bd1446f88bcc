""":func:`convert`: arguments, plan, then the shards, the small files and the manifest last."""
from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import torch

from .. import __version__
from ..card import CARD_NAME, write_model_card
from ..checkpoint import (CONFIG_NAME, MANIFEST_NAME, SAFE_INDEX_NAME, SHARD_METADATA, CheckpointError,
                          SourceCheckpoint, dtype_name, is_disk_full, sha256_file)
from ..checkpoint.experts import split_stacked_experts
from ..checkpoint.writer import make_index, make_quantization_config, safetensors_size, shard_name, write_json
from ..checkpoint.hub import resolve_source
from ..modules.linear import linear_dims
from ..schemes import SCHEMES
from .options import DEFAULT_GROUP_SIZE, check_arguments, default_output_name, resolve_dtype
from .output import (PARTIAL_SUFFIX, PROGRESS_NAME, OutputLock, check_output_name, check_replaceable_output,
                     conversion_fingerprint, fsync_dir, make_manifest, make_partial, publish, resume_state)
from .plan import (Unit, plan_linears, canonical_names, check_complete, check_expert_blocks, expert_count,
                   expert_tensors, linear_modules, model_structure, natural_key, nothing_to_quantize, plan_experts,
                   tied_word_embeddings)
from .summary import ConvertSummary, LayerResult, format_size
from .writer import write_shards

GPTQ_STORE = "gptq-blocks"  # calibrated layers, in the partial directory until written into their shards


def convert(source, output=None, *, bits: int | None = None, group_size: int | None = DEFAULT_GROUP_SIZE,
            axis: int = 1, method: str | None = None, scheme: str | None = None, dtype=None, device: str = "auto",
            skip=(), bits_for=(), quantize_lm_head: bool = False, max_shard_size="5GB", dry_run: bool = False,
            overwrite: bool = False, strict: bool = False, revision: str | None = None, token: str | None = None,
            allow_pickle: bool = False, progress: bool = True, trust_remote_code: bool = False, calibration=None,
            calibration_length: int | None = None) -> ConvertSummary:
    """Convert ``source`` (hub repo id or local directory) into a packed checkpoint at ``output``.

    ``scheme``: ``None`` (weight-only ``w<bits>a16``: ``bits`` 4 by default, ``method`` hqq by
    default; ``"sinq"`` first moves Sinkhorn column scales into the norms and producing rows of
    Llama-style decoder blocks where they lower the estimated error, see :mod:`quantpack.quantization.sinq`),
    ``"w4a16"``, ``"w8a16"``, or ``"w8a8"`` (int8 weights, one float32 scale per output channel, for
    the int8 x int8 kernels; the weight-only arguments ``bits``, ``group_size``,
    ``axis``, ``method`` and ``bits_for`` must then be left out, see :func:`resolve_scheme`).
    ``output`` defaults to ``<model-name>-qp<bits>g<group_size>`` (``<model-name>-qpw8a8``) in the
    current directory.
    ``skip``: regexes (``re.search`` on module names) of linear modules to leave unquantized;
    ``bits_for``: ``"REGEX=BITS"`` strings (or (regex, bits) pairs), first match wins.
    ``dtype`` (bfloat16/float16) is the output dtype of scales, zeros and every unquantized floating
    tensor; default: the source weights' dtype if half precision, else bfloat16.
    ``calibration``: a UTF-8 text file (or ``"builtin"``, a short shipped passage; or ``"self"``: text the causal
    LM samples itself at the start, see :mod:`quantpack.quantization.calibration`) for ``method="gptq"``
    (implied): GPTQ's error-compensating rounding on hqq's group parameters, with the Hessians of each decoder
    block's inputs on that text, one block at a time (see :mod:`quantpack.quantization.gptq`); ``calibration_length``:
    tokens per calibration sequence (default 512, at most the model's context). ``"self"`` on a model that is not
    a causal LM (an encoder), with ``method`` left out: ``refit`` of the 4-bit layers weighted by the second moments
    of their inputs on token sequences sampled from the vocabulary (8-bit layers: hqq; see
    :func:`quantpack.quantization.calibration.zipf_token_sequences`); ``calibration_length`` caps those sequences.
    ``trust_remote_code``: let transformers run the Python code the checkpoint ships for its config and
    model (``auto_map``); off by default, so such a checkpoint is refused and nothing ever prompts.
    Raises ``ValueError`` (:class:`~quantpack.checkpoint.CheckpointError` for checkpoint and disk
    problems) with a one-line message on bad input, before anything is written when it can.
    """
    t0 = time.perf_counter()
    args = check_arguments(bits=bits, group_size=group_size, axis=axis, method=method, scheme=scheme, device=device,
                           skip=skip, bits_for=bits_for, max_shard_size=max_shard_size, calibration=calibration)
    scheme, bits, group_size, axis, method = args.scheme, args.bits, args.group_size, args.axis, args.method
    skip, skip_patterns, bits_rules, shard_limit, dev = args.skip, args.skip_patterns, args.bits_rules, \
        args.shard_limit, args.device
    w8a8 = scheme == "w8a8"

    resolved = resolve_source(source, revision=revision, token=token, allow_pickle=allow_pickle,
                              trust_remote_code=trust_remote_code)
    src = SourceCheckpoint(resolved.path, allow_pickle=allow_pickle)
    held = ExitStack()  # the output lock, once taken
    try:
        config_dict = src.config()
        if config_dict.get("quantization_config") is not None and not isinstance(config_dict["quantization_config"],
                                                                                 dict):
            raise CheckpointError(f"{resolved.path / CONFIG_NAME}: quantization_config is "
                                  f"a JSON {type(config_dict['quantization_config']).__name__.replace('list', 'array')}, not an object; "
                                  f"download the checkpoint again")
        if config_dict.get("quantization_config"):
            qm = config_dict["quantization_config"].get("quant_method", "unknown")
            raise CheckpointError(f"source: is already quantized (quant_method={qm!r}); convert from the original "
                                  f"floating-point checkpoint")
        weight_names = set(src.tensors)
        model, config, head = model_structure(config_dict, resolved.path, weight_names, trust_remote_code)
        check_expert_blocks(model)
        src = split_stacked_experts(model, src)  # (gpt-oss's stacked experts as one matrix per expert)
        expert_sources, block_renames = expert_tensors(model, src.tensors)
        canonical, dropped = canonical_names(model, src.tensors, expert_sources, block_renames)
        linears, output_names, absent = linear_modules(model, weight_names)
        out_dtype = resolve_dtype(dtype, src, [found for _, found in linears.values()])
        settings = {"scheme": scheme, "bits": bits, "group_size": group_size, "axis": axis, "method": method,
                    "dtype": dtype_name(out_dtype), "skip": list(skip),
                    "bits_for": {p.pattern: b for p, b in bits_rules}, "quantize_lm_head": quantize_lm_head,
                    "max_shard_size": shard_limit}
        out_path = Path(output) if output is not None else Path(default_output_name(resolved.name, bits, group_size, scheme))
        out_path = out_path.expanduser().absolute()
        check_output_name(out_path, given=output is not None)
        summary = ConvertSummary(source=resolved.repo, revision=resolved.revision, output=str(out_path),
                                 dry_run=dry_run, settings={**settings, "device": dev.type})

        # -- decide each linear module
        tied = tied_word_embeddings(config)
        for name, is_output in absent:
            module = model.get_submodule(name)
            reason = ("tied to the input embeddings (not stored)" if is_output and tied
                      else "no weight in the checkpoint")
            summary.layers.append(LayerResult(name, linear_dims(module)[:2], skipped=reason))
        experts = expert_count(config)
        if head:
            summary.warnings.append(f"{CONFIG_NAME} asks for {head}, but the checkpoint holds "
                                    f"only its base model's weights: converted as {type(model).__name__}, as "
                                    f"transformers' AutoModel loads it (recorded in the output's architectures)")
        if dropped:
            summary.warnings.append(f"dropped {len(dropped)} stored tensors that are not parameters of "
                                    f"{type(model).__name__} (transformers skips them too): "
                                    f"{', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}")
        quant_plan, bits_overrides = plan_linears(linears, src, summary, args, output_names=output_names, tied=tied,
                                                  experts=experts, quantize_lm_head=quantize_lm_head, strict=strict)
        quantized_experts = plan_experts(model, src, expert_sources, summary, quant_plan, bits_overrides,
                                          skip_patterns, bits_rules, bits, group_size, axis, w8a8)
        check_complete(model, canonical, quantized_experts)
        summary.layers.sort(key=lambda layer: natural_key(layer.name))
        # A pattern that selects nothing is almost always a typo: say so (and stop under --strict).
        for option, patterns in (("--skip", skip_patterns), ("--bits-for", [p for p, _ in bits_rules])):
            for pattern in patterns:
                if not any(pattern.search(name) for name in [*linears, *quant_plan]):
                    message = f"{option} {pattern.pattern} matches no linear layer"
                    if strict:
                        raise ValueError(f"{message} (--strict); check the pattern against the layer names "
                                         f"(--dry-run lists them)")
                    summary.warnings.append(message)
        if not quant_plan:
            raise ValueError(nothing_to_quantize(summary.layers, bits, group_size, axis))
        encoder_batch = None  # --calibration on a model that is not a causal LM: the inputs its refit is weighted by
        if method == "gptq":  # refused or tokenized before anything is written
            from ..quantization import calibration as cal
            from ..quantization.gptq import SELF_SHRINK, check_model, decoder_blocks

            try:
                decoder_blocks(model, config, advice=(
                    "for an encoder, pass --calibration without --method (refit weighted by its activations on the "
                    "text, or on sampled inputs with 'self'), or --method hqq"))
            except ValueError:
                if args.method_given:
                    raise
                method = settings["method"] = summary.settings["method"] = "refit"
            if method == "refit":
                encoder_batch = _encoder_inputs(config, quant_plan, quantized_experts, resolved.path,
                                                args.calibration, calibration_length, trust_remote_code)
                given = ({"self": True, "seed": args.calibration.seed, "sampler": "zipf"}
                         if isinstance(args.calibration, cal.SelfCalibration) else
                         {"sha256": args.calibration.sha256,
                          **({"builtin": True} if args.calibration.source == cal.BUILTIN else {})})
                settings["calibration"] = summary.settings["calibration"] = {
                    **given, "tokens": int(encoder_batch["attention_mask"].sum()),
                    "sequences": encoder_batch["input_ids"].shape[0],
                    "sequence_length": encoder_batch["input_ids"].shape[1]}
        if method == "gptq":
            check_model(model, config, quant_plan, quantized_experts)
            tokenizer = cal.load_tokenizer(resolved.path, trust_remote_code)
            length = cal.sequence_length(config, calibration_length)
            if isinstance(args.calibration, cal.SelfCalibration):  # written by the model once calibrating starts
                tokens = None
                settings["calibration"] = {"self": True, "seed": args.calibration.seed,
                                           "tokens": cal.DEFAULT_MAX_SEQUENCES * length,
                                           "sequences": cal.DEFAULT_MAX_SEQUENCES, "sequence_length": length,
                                           "shrink": SELF_SHRINK}
            else:
                tokens = cal.token_sequences(args.calibration, tokenizer, length)
                settings["calibration"] = {"sha256": args.calibration.sha256, "tokens": tokens.numel(),
                                           "sequences": tokens.shape[0], "sequence_length": tokens.shape[1],
                                           **({"builtin": True} if args.calibration.source == cal.BUILTIN else {})}
            summary.settings["calibration"] = settings["calibration"]

        # -- units in source order, then shards
        units = []
        for tname, info in src.tensors.items():
            if tname not in canonical:
                continue  # dropped: the model ignores it
            out_name = canonical[tname]
            module = out_name[: -len(".weight")] if out_name.endswith(".weight") else None
            if module in quant_plan:
                layer = quant_plan[module]
                stored = SCHEMES[scheme].stored(layer.shape, layer.bits, layer.group_size, axis, out_dtype)
                units.append(Unit(tname, {f"{module}.{suffix}": sd for suffix, sd in stored.items()}, layer))
            else:
                out_t = out_dtype if info.dtype.is_floating_point else info.dtype
                units.append(Unit(tname, {out_name: (info.shape, out_t)}))
        shards: list[list[Unit]] = [[]]
        running = 0
        for unit in units:
            if shards[-1] and running + unit.nbytes > shard_limit:
                shards.append([])
                running = 0
            shards[-1].append(unit)
            running += unit.nbytes
        names = [shard_name(i + 1, len(shards)) for i in range(len(shards))]
        shard_sizes = [safetensors_size({n: sd for u in s for n, sd in u.outputs.items()}, SHARD_METADATA)
                       for s in shards]
        summary.num_tensors = sum(len(u.outputs) for u in units)
        summary.num_shards = len(shards)
        summary.source_bytes = src.total_bytes
        summary.output_bytes = sum(shard_sizes)
        other_files = src.other_files()
        needed = summary.output_bytes + sum((resolved.path / f).stat().st_size for f in other_files) + (1 << 20)
        if method == "gptq":  # the calibrated layers wait in the partial directory until their shard is written
            needed += sum(u.nbytes for u in units if u.layer is not None)

        # -- output location, disk space
        partial = out_path.parent / f".{out_path.name}{PARTIAL_SUFFIX}"
        check_replaceable_output(out_path, resolved.path, overwrite)
        probe = out_path.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise CheckpointError(f"output: cannot create {out_path}: {probe} is not a directory; choose another --output")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise CheckpointError(f"output: cannot create {out_path}: {probe} is not writable; choose another --output")
        if resolved.local and out_path.resolve().is_relative_to(resolved.path):
            raise CheckpointError(f"output: {out_path} is inside the source checkpoint {resolved.path}; "
                                  f"choose an --output outside it")
        summary.disk_free = shutil.disk_usage(probe).free
        already = sum(f.stat().st_size for f in partial.glob("*.safetensors")) \
            if partial.is_dir() and not partial.is_symlink() else 0
        if summary.disk_free + already < needed:
            raise CheckpointError(f"output: needs about {format_size(needed)} free on {probe} but only "
                                  f"{format_size(summary.disk_free)} is available; free space or choose another --output")
        summary.timings["plan"] = time.perf_counter() - t0
        if dry_run:
            summary.seconds = time.perf_counter() - t0
            return summary

        created = False
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(OutputLock(out_path))
            check_replaceable_output(out_path, resolved.path, overwrite)  # again: another run may have finished
            created = make_partial(partial)
            if not os.access(partial, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise CheckpointError(f"output: cannot create {e.filename or partial}: {e.strerror or e}; choose a "
                                  f"writable --output") from None

        # -- inputs are hashed in the background while converting
        input_files = sorted(set(src.weight_files) | set(other_files) | {CONFIG_NAME} |
                             ({src.index_file} if src.index_file else set()))
        hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qp-hash")
        input_hashes = {f: hasher.submit(sha256_file, resolved.path / f) for f in input_files}

        fingerprint = conversion_fingerprint(resolved, src, settings, dev, names)
        done = resume_state(partial, fingerprint, names, summary.settings)
        summary.resumed_shards = len(done)
        rescale = {}
        if method == "sinq":
            from ..quantization import sinq

            source_of = {v: k for k, v in canonical.items()}
            rescale, kept = sinq.plan(source_of, lambda n: src.get(source_of[n]), model, bits=bits,
                                      group_size=group_size, device=dev)
            rescale = {source_of[n]: v for n, v in rescale.items()}
            settings["sinq_scales"] = kept  # recorded (not fingerprinted: derived), so verify can redo them
        precomputed = {}
        if method == "gptq" and len(done) < len(names):
            from ..quantization.gptq import quantize_blocks

            source_of = {v: k for k, v in canonical.items()}
            if tokens is None:
                t_gen = time.perf_counter()
                count, length = settings["calibration"]["sequences"], settings["calibration"]["sequence_length"]
                try:
                    tokens = cal.self_calibration_tokens(
                        type(model), resolved.path, tokenizer, config.get_text_config().vocab_size, count, length,
                        device=dev, dtype=out_dtype if dev.type == "cuda" else torch.float32,
                        seed=settings["calibration"]["seed"], trust_remote_code=trust_remote_code)
                except ValueError:  # the model did not fit: nothing of this run to keep
                    if created:
                        shutil.rmtree(partial, ignore_errors=True)
                    raise
                summary.timings["generate"] = time.perf_counter() - t_gen
            t_cal = time.perf_counter()
            precomputed = quantize_blocks(type(model), config, lambda n: src.get(source_of[n]), quant_plan, tokens,
                                          store=partial / GPTQ_STORE, dtype=out_dtype, device=dev,
                                          shrink=settings["calibration"].get("shrink", 0.0), progress=progress)
            summary.timings["calibrate"] = time.perf_counter() - t_cal
        input_weights = None
        if encoder_batch is not None and len(done) < len(names):  # recomputed on resume: deterministic, one forward
            t_cal = time.perf_counter()
            try:
                input_weights = cal.self_input_moments(
                    type(model), resolved.path, [n for n, layer in quant_plan.items() if layer.bits == 4],
                    encoder_batch, device=dev, trust_remote_code=trust_remote_code)
            except ValueError:  # nothing of this run to keep
                if created:
                    shutil.rmtree(partial, ignore_errors=True)
                raise
            summary.timings["calibrate"] = time.perf_counter() - t_cal
        try:
            write_shards(src, shards, names, partial, done, fingerprint, scheme, axis,
                         "hqq" if method in ("sinq", "gptq") or encoder_batch is not None else method, dev, out_dtype,
                         progress, summary, rescale, precomputed, input_weights)
            shutil.rmtree(partial / GPTQ_STORE, ignore_errors=True)
            t_finish = time.perf_counter()
            # -- the small files, then the manifest last
            for rel in other_files:
                target = partial / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(resolved.path / rel, target)
            write_model_card(partial, resolved=resolved, settings=settings, summary=summary,
                             name=default_output_name(resolved.name, bits, group_size, scheme))
            quant_config = make_quantization_config(
                bits=bits, group_size=group_size, axis=axis, method=method,
                modules_not_converted=[layer.name for layer in summary.skipped if layer.name in linears],
                bits_overrides=bits_overrides, version=__version__, scheme=scheme, quantized_experts=quantized_experts)
            new_config = {**config_dict, "quantization_config": quant_config}
            if head:  # what was built, so that loading and verifying build the same
                new_config["architectures"] = [type(model).__name__]
            for key in ("dtype", "torch_dtype"):
                if key in new_config or key == "dtype":
                    new_config[key] = dtype_name(out_dtype)
            write_json(partial / CONFIG_NAME, new_config)
            weight_map = {n: names[i] for i, shard in enumerate(shards) for u in shard for n in u.outputs}
            data_bytes = sum(u.nbytes for u in units)
            write_json(partial / SAFE_INDEX_NAME, make_index(weight_map, data_bytes))
            outputs = {name: done[name] for name in names}
            for rel in sorted(set(other_files) | {CONFIG_NAME, SAFE_INDEX_NAME, CARD_NAME}):
                outputs[rel] = {"sha256": sha256_file(partial / rel), "size": (partial / rel).stat().st_size}
            inputs = {}
            for rel, fut in input_hashes.items():
                inputs[rel] = {"sha256": fut.result(), "size": (resolved.path / rel).stat().st_size}
            manifest = make_manifest(resolved, settings, dev, inputs, outputs, summary)
            (partial / PROGRESS_NAME).unlink(missing_ok=True)
            write_json(partial / MANIFEST_NAME, manifest)
            fsync_dir(partial)
            publish(partial, out_path, resolved.path, overwrite)
            summary.timings["finish"] = time.perf_counter() - t_finish
        except CheckpointError:  # a bad source value: nothing of this run is worth keeping for a resume
            if created:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        except OSError as e:
            if is_disk_full(e):
                raise CheckpointError(f"output: disk full while writing {partial} ({e.strerror}); free space and "
                                      f"re-run the same command to resume") from None
            raise CheckpointError(f"output: cannot write {partial}: {e.strerror or e}") from None
        finally:
            hasher.shutdown(wait=True, cancel_futures=True)
        summary.seconds = time.perf_counter() - t0
        return summary
    finally:
        held.close()
        src.close()


def _encoder_inputs(config, quant_plan: dict, expert_blocks, path: Path, calibration, calibration_length: int | None,
                    trust_remote_code: bool) -> dict[str, torch.Tensor]:
    """``--calibration`` on a model that is not a causal LM: the token sequences its refit is weighted by, sampled
    from its vocabulary (``self``, :func:`quantpack.quantization.calibration.zipf_token_sequences`) or cut from the text
    (:func:`quantpack.quantization.calibration.encoder_text_sequences`), after refusing, with one line, what it cannot
    calibrate."""
    from ..quantization import calibration as cal

    label = cal.SELF if isinstance(calibration, cal.SelfCalibration) else calibration.source
    if expert_blocks:
        raise ValueError(f"calibration: {label} does not calibrate mixture-of-experts blocks yet ({expert_blocks[0]}); "
                         f"use --method hqq")
    if not any(layer.bits == 4 for layer in quant_plan.values()):
        raise ValueError(f"calibration: {label} refits the 4-bit layers of an encoder (8-bit ones keep hqq, which "
                         f"measured better there) and none is 4-bit; drop --calibration")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    lengths = cal.encoder_body_lengths(text, calibration_length)
    tokenizer = cal.load_tokenizer(path, trust_remote_code)
    if not isinstance(calibration, cal.SelfCalibration):
        return cal.encoder_text_sequences(calibration, tokenizer, lengths[1])
    vocab_size = getattr(text, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"calibration: self samples token ids but {type(config).__name__} has no vocab_size (not a "
                         f"text model?); use --method hqq")
    return cal.zipf_token_sequences(tokenizer, vocab_size, lengths=lengths, seed=calibration.seed)
