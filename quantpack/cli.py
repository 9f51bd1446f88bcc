"""The ``quantpack`` command line: thin commands over the library API; ``--help`` is the documentation."""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading

import click

from . import __version__


class UsageFailure(click.ClickException):
    """A bad-input error: one line on stderr, exit code 2, no traceback."""

    exit_code = 2

    def show(self, file=None):
        click.echo(f"Error: {self.format_message()}", err=True, file=file)


class Interrupted(click.ClickException):
    """Ctrl-C (exit 130) or SIGTERM (exit 143) while a command ran; ``message`` says what was kept."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + signum

    def show(self, file=None):
        click.echo(self.format_message(), err=True, file=file)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it unwinds as Ctrl-C does: locks released, partial output
    kept for a resume."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _interrupted(message: str, error: KeyboardInterrupt) -> Interrupted:
    """``message`` as a :class:`Interrupted` for Ctrl-C or SIGTERM, whichever ``error`` was."""
    signum = signal.SIGTERM if isinstance(error, Terminated) else signal.SIGINT
    return Interrupted(("Terminated" if signum == signal.SIGTERM else "Interrupted") + message, signum)


def _wants_json(args) -> bool:
    """Whether the command line asks for --json (before any ``--``)."""
    args = list(sys.argv[1:] if args is None else args)
    return "--json" in (args[:args.index("--")] if "--" in args else args)


class OneLineErrors(click.Group):
    """Click's own usage errors (bad option values, unknown options) as one line, exit 2, like ours; with
    --json, also a JSON error object on stdout (``{"error": ..., "exit_code": ...}``) unless the command already
    printed its JSON report. SIGTERM unwinds as Ctrl-C does."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        global _json_printed
        _json_printed = False
        main_thread = threading.current_thread() is threading.main_thread()  # (signal handlers are set only there)
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            self._fail(args, f"Error: {' '.join(e.format_message().split())}{where}", 2)
        except Interrupted as e:
            self._fail(args, e.format_message(), e.exit_code)
        except click.ClickException as e:
            self._fail(args, f"Error: {e.format_message()}", e.exit_code)
        except (click.Abort, KeyboardInterrupt) as e:  # outside a command's own handling
            e = _interrupted(".", e if isinstance(e, KeyboardInterrupt) else KeyboardInterrupt())
            self._fail(args, e.format_message(), e.exit_code)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
        sys.exit(code if isinstance(code, int) else 0)

    @staticmethod
    def _fail(args, line: str, exit_code: int):
        click.echo(line, err=True)
        if _wants_json(args) and not _json_printed:
            click.echo(json.dumps({"error": line.removeprefix("Error: "), "exit_code": exit_code}))
        sys.exit(exit_code)


_json_printed = False  # whether this process printed a command's JSON report (so that an error adds no second one)


def _echo_json(text: str) -> None:
    """A command's --json report on stdout."""
    global _json_printed
    click.echo(text)
    _json_printed = True


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="quantpack")
def cli():
    """quantpack: quantize Hugging Face checkpoints to packed 4/8-bit weights and run them fast.

    \b
    Typical use:
      quantpack convert meta-llama/Llama-3.1-8B --group-size 128
      quantpack verify Llama-3.1-8B-qp4g128
      quantpack tune Llama-3.1-8B-qp4g128
    """
    from .env import EnvError, check_environment

    try:
        check_environment()
    except EnvError as e:
        raise UsageFailure(str(e)) from None
    _show_library_warnings(click.get_current_context())


class _StderrLines(logging.Handler):
    """The library's warnings (logger ``quantpack``) as ``warning: ...`` lines on stderr."""

    def emit(self, record):
        click.echo(f"{record.levelname.lower()}: {record.getMessage()}", err=True)


def _show_library_warnings(ctx: click.Context) -> None:
    """Print the library's warnings while this command runs, and only through this handler."""
    logger = logging.getLogger("quantpack")
    handler, propagate = _StderrLines(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False

    def restore():
        logger.removeHandler(handler)
        logger.propagate = propagate
    ctx.call_on_close(restore)


def _progress_wanted(*off: bool) -> bool:
    """Progress bars only on a terminal: redirected to a file or a pipe, their redraws fill logs."""
    return not any(off) and sys.stderr.isatty()


def _echo_warnings(warnings) -> None:
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


QUIET_HELP = ("Print no progress and no report; warnings and errors still go to stderr, and the exit code tells the "
              "result.")


def main(argv=None):
    cli.main(args=argv, prog_name="quantpack")


# (format.py's MIN_GROUP_SIZE and MAX_GROUP_SIZE, spelled out so that --help need not import torch; a test holds
# them equal)
GROUP_SIZES_HELP = "a power of two from 16 to 1024, or 'none' for per-channel"


class GroupSize(click.ParamType):
    """``--group-size``: a power of two in format.py's range, or ``none`` (per-channel) -> ``None``."""

    name = "group size"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        if value.lower() in ("none", "channel", "per-channel"):
            return None
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size <= 0:  # as a param type, click names the option in the message
            self.fail(f"{value!r} is not a positive integer or 'none'", param, ctx)
        from .format import check_group_size

        try:
            check_group_size(size)
        except ValueError:
            self.fail(f"{size} is not {GROUP_SIZES_HELP}", param, ctx)
        return size


class Checked(click.ParamType):
    """An option value a library function checks (raising ValueError), kept as written; a bad one is refused
    naming the option (click adds it) with ``problem``, where ``{error}`` stands for the library's reason."""

    def __init__(self, name: str, check, problem: str):
        self.name, self.check, self.problem = name, check, problem

    def convert(self, value, param, ctx):
        try:
            self.check(value)
        except ValueError as e:
            self.fail(f"{value!r} " + self.problem.format(error=e), param, ctx)
        return value


def _parse_size(value):
    from .sizes import parse_size

    parse_size(value)


def _compile_regex(value):
    import re

    try:
        re.compile(value)
    except re.error as e:
        raise ValueError(f"({e})") from None


def _parse_bits_rule(value):
    from .convert.options import parse_bits_for

    parse_bits_for([value])


@cli.command("convert", short_help="Convert a hub repo or local checkpoint to packed 4/8-bit weights.")
@click.argument("source")
@click.option("-o", "--output", type=click.Path(file_okay=False), help="Output directory [default: <model-name>-qp<bits>g<group>, or <model-name>-qpw8a8].")
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True, help="Bits per weight.")
@click.option("--group-size", type=GroupSize(), default="128", show_default=True, metavar="N|none",
              help=f"Weights per scale/zero group: {GROUP_SIZES_HELP}.")
@click.option("--axis", type=click.Choice(["1", "0"]), default="1", show_default=True,
              help="1: groups along in-features; 0: along out-features.")
@click.option("--method", type=click.Choice(["hqq", "rtn", "sinq", "refit", "gptq"]), default="hqq",
              show_default=True,
              help="hqq: optimized zero points; rtn: round to nearest; sinq: hqq after moving Sinkhorn-balanced "
                   "input-feature scales into the norms and producing rows of Llama-style decoder blocks (same "
                   "format, same function; slower to convert); refit: least-squares scale and zero per group "
                   "from hqq's start (lower weight error than hqq; about 2x hqq's quantizing time); gptq: hqq's "
                   "groups with GPTQ's error-compensating rounding, calibrated on --calibration text, one decoder "
                   "block at a time (same format).")
@click.option("--calibration", metavar="FILE|self|builtin", help="UTF-8 text to calibrate on (implies --method "
              "gptq): text like the model's own data, ideally 100k+ tokens; 'self': no text needed, a causal LM "
              "samples its own (128 sequences, on --device, holding the whole model there while it writes) and GPTQ "
              "rounds on their Hessians shrunk halfway to the diagonal. On an encoder (not a causal LM) the "
              "calibration inputs (the text cut into windows of 64 tokens between [CLS] and [SEP], at most 128; "
              "'self': 128 token sequences sampled from its vocabulary) run through it once (float32, on --device) "
              "and the 4-bit layers are refit weighted by their inputs' second moments (8-bit layers: hqq); "
              "'builtin': a short shipped passage, for a quick try.")
@click.option("--calibration-length", type=click.IntRange(min=2), metavar="N",
              help="Tokens per calibration sequence [default: 512, at most the model's context; an encoder's: "
                   "66 (its 'self': 10 to 66), this caps them].")
@click.option("--scheme", type=click.Choice(["w4a16", "w8a16", "w8a8"]),
              help="w4a16/w8a16: weight-only (the default, by --bits). w8a8: int8 weights, one scale per output "
                   "channel, and int8 activations at run time (int8 tensor cores); --group-size, --axis, --method "
                   "and --bits-for do not apply to it.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16"]), default="auto", show_default=True,
              help="Dtype of scales, zeros and unquantized tensors (auto: the source's half dtype, else bfloat16).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to quantize (auto: a GPU when present).")
@click.option("--skip", type=Checked("regex", _compile_regex, "is not a valid regular expression {error}"),
              multiple=True, metavar="REGEX", help="Leave linear modules matching REGEX unquantized (repeatable).")
@click.option("--bits-for", type=Checked("rule", _parse_bits_rule, "is not REGEX=BITS with a valid REGEX and BITS 4 "
                                                                   "or 8, e.g. down_proj=8"),
              multiple=True, metavar="REGEX=BITS", help="Bits for modules matching REGEX, e.g. down_proj=8 (repeatable).")
@click.option("--quantize-lm-head", is_flag=True,
              help="Also quantize the output embeddings (lm_head), unless tied. With --bits-for lm_head=8: 2-4% faster "
                   "decode at no measured quality cost; the vLLM plugin serves only a bf16 lm_head.")
@click.option("--max-shard-size", type=Checked("size", _parse_size, "is not a positive size; use e.g. 5GB, 500MB or 2GiB"),
              default="5GB", show_default=True, help="Largest output shard, e.g. 5GB, 500MB, 2GiB.")
@click.option("--dry-run", is_flag=True, help="Print the plan and check free disk space; write nothing.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing output directory that is a finished quantpack output (never any other folder).")
@click.option("--strict", is_flag=True, help="Fail on layers the group size does not fit instead of skipping them.")
@click.option("--revision", help="Hub branch, tag or commit.")
@click.option("--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token for private or gated repos.")
@click.option("--allow-pickle", is_flag=True, help="Allow PyTorch .bin sources (loaded with weights_only=True).")
@click.option("--trust-remote-code", is_flag=True, help="Run the Python code a checkpoint ships for its model "
              "(auto_map in config.json); only for repositories you trust.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON summary on stdout.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars (shown only when stderr is a terminal).")
@click.option("-q", "--quiet", is_flag=True, help=QUIET_HELP.replace("report", "summary"))
def convert_command(source, output, bits, group_size, axis, method, calibration, calibration_length, scheme, dtype,
                    device, skip, bits_for, quantize_lm_head, max_shard_size, dry_run, overwrite, strict, revision, token, allow_pickle,
                    trust_remote_code, as_json, no_progress, quiet):
    """Convert a Hugging Face checkpoint (hub repo id or local directory) to a packed 4/8-bit checkpoint.

    Streams tensor by tensor, resumes an interrupted run, and never leaves a half-written output.
    Quantizes every linear layer (nn.Linear, GPT-2's Conv1D) and every expert of a mixture-of-experts
    block (Mixtral, Qwen3-MoE, ...), but not the output embeddings (see --quantize-lm-head) or MoE
    routers; other tensors are copied. Gated hub models need a token (--token or HF_TOKEN).

    \b
    Examples:
      quantpack convert meta-llama/Llama-3.1-8B --group-size 128
      quantpack convert ./my-model --bits 8 --group-size none --dry-run
      quantpack convert ./my-model --scheme w8a8
      # GPTQ calibrated on your text, or on text the model writes itself
      # (an encoder: a weighted refit):
      quantpack convert ./my-model --calibration my-text.txt
      quantpack convert ./my-model --calibration self
    """
    from click.core import ParameterSource

    from .convert import convert

    ctx = click.get_current_context()
    given = {name for name in ("bits", "group_size", "axis", "method", "bits_for")
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)}
    if scheme == "w8a8":
        refused = sorted(given - ({"bits"} if bits == "8" else set()))
        if refused:
            options = ", ".join("--" + name.replace("_", "-") for name in refused)
            raise UsageFailure(f"{options}: not used by --scheme w8a8 (always int8, one symmetric scale per output "
                               f"channel); drop {'them' if len(refused) > 1 else 'it'}")
    try:
        summary = convert(source, output, bits=int(bits) if "bits" in given else None,
                          group_size=group_size, axis=int(axis),
                          method=method if "method" in given else None, scheme=scheme, dtype=dtype, device=device,
                          skip=skip, bits_for=bits_for,
                          quantize_lm_head=quantize_lm_head, max_shard_size=max_shard_size, dry_run=dry_run,
                          overwrite=overwrite, strict=strict, revision=revision, token=token,
                          allow_pickle=allow_pickle, progress=_progress_wanted(no_progress, as_json, quiet),
                          trust_remote_code=trust_remote_code, calibration=calibration,
                          calibration_length=calibration_length)
    except click.ClickException:
        raise
    except ValueError as e:  # includes CheckpointError: bad input, already one line
        raise UsageFailure(" ".join(str(e).split())) from None
    except KeyboardInterrupt as e:
        raise _interrupted(": finished shards are kept; re-run the same command to resume.", e) from None
    if as_json:
        from .checkpoint import finite_or_none

        _echo_json(json.dumps(finite_or_none(summary.to_dict()), indent=2, allow_nan=False))
    elif not quiet:
        if dry_run:
            click.echo(summary.format_plan() + "\n")
        click.echo(summary.format_table())
    _echo_warnings(summary.warnings)


@cli.command("demo", short_help="Build a small Llama, convert it and verify it, offline.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Where to build the model and its packed copy [default: a new temporary directory].")
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True, help="Bits per weight.")
@click.option("--group-size", type=GroupSize(), default="32", show_default=True, metavar="N|none",
              help=f"Weights per group: {GROUP_SIZES_HELP}.")
@click.option("--method", type=click.Choice(["hqq", "rtn"]), default="hqq", show_default=True, help="Quantization method.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True, help="Where to quantize and run.")
def demo_command(workdir, bits, group_size, method, device):
    """Run the whole job offline: build a small real Llama, convert it, verify it.

    The model (2 layers, hidden size 128, a trained BPE tokenizer, sharded safetensors) is fitted for
    a few seconds to the built-in passage, then converted with the same code as `quantpack convert` and
    checked with `quantpack verify`. Nothing is downloaded. The fit makes the model confident at enough
    positions of the passage that the KL and top-1 checks both judge it; the integrity, per-layer and
    kernel checks run as on any checkpoint.
    Exit code: as `quantpack verify`.
    """
    from .demo import run_demo

    try:
        result = run_demo(workdir, bits=int(bits), group_size=group_size, method=method, device=device,
                          progress=_progress_wanted())
    except ValueError as e:
        raise UsageFailure(" ".join(str(e).split())) from None
    click.echo(result.conversion.format_table() + "\n")
    click.echo(result.report.format_table())
    _echo_warnings(result.conversion.warnings + result.report.warnings)
    click.echo(f"\nsource model   {result.source}\npacked model   {result.packed}")
    if result.report.exit_code:
        sys.exit(result.report.exit_code)


@cli.command("tune", short_help="Time the kernels for a packed model on this GPU, ahead of use.")
@click.argument("source")
@click.option("--batch-sizes", default="1,16,64,256,1024", show_default=True, metavar="M,...",
              help="Rows of x per call to tune for (tokens of a prefill, sequences of a decode step); each stands "
                   "for its power-of-two bucket.")
@click.option("--device", default="cuda", show_default=True, help="The GPU to time on (cuda, cuda:1, ...).")
@click.option("--backward", is_flag=True, help="Also tune the transposed product of the backward pass (for training "
              "adapters on the quantized model).")
@click.option("--revision", help="Hub revision (branch, tag or commit) of SOURCE.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help=QUIET_HELP)
def tune_command(source, batch_sizes, device, backward, revision, as_json, quiet):
    """Tune the fused kernels for one packed model on this machine's GPU, once, ahead of use.

    quantpack ships configs tuned on an H100 and an H200 for common layer shapes. On another GPU, or
    for other shapes, each call takes the nearest tuned config untimed (or, with QUANTPACK_AUTOTUNE=1,
    is timed on first use: a pause of seconds per layer shape). This command loads SOURCE (a packed
    checkpoint directory or hub repo id) on the GPU and times every layer shape, merged q/k/v and
    gate/up included, at each batch size the tables lack. The picks go to this machine's config cache
    ($QUANTPACK_CACHE_DIR, else ~/.cache/quantpack), which every later run reads. Expect minutes
    the first time on a machine: every candidate kernel compiles once (Triton caches them).

    \b
    Examples:
      quantpack tune Llama-3.1-8B-qp4g128
      quantpack tune ./my-model-qp4g128 --batch-sizes 1,8,32,512 --device cuda:1
      # LoRA training at 2048 tokens:
      quantpack tune ./my-model-qp4g128 --batch-sizes 2048 --backward
    """
    from .tune import parse_batch_sizes, tune

    try:
        report = tune(source, batch_sizes=parse_batch_sizes(batch_sizes), device=device, backward=backward,
                      revision=revision, progress=_progress_wanted(as_json, quiet))
    except ValueError as e:
        raise UsageFailure(" ".join(str(e).split())) from None
    if as_json or not quiet:
        (_echo_json if as_json else click.echo)(report.to_json() if as_json else report.format_table())


@cli.command("verify", short_help="Check packed checkpoints' files and accuracy against their source.")
@click.argument("packed", nargs=-1, required=True)
@click.option("--reference", metavar="SRC", help="The original checkpoint (hub repo id or directory) "
              "[default: the source recorded in quantpack.json].")
@click.option("--no-reference", is_flag=True, help="Check only the files and the kernels; no reference needed.")
@click.option("--text-file", type=click.Path(dir_okay=False), help="Evaluate on this UTF-8 text [default: a built-in passage].")
@click.option("--max-kl", type=float, default=0.1, show_default=True, help="Largest mean KL divergence (nats per token), causal LMs.")
@click.option("--min-top1", type=float, default=0.8, show_default=True, help="Smallest top-1 agreement over the positions where the reference is confident (skipped when "
                   "fewer than 32), causal LMs.")
@click.option("--min-cosine", type=float, default=0.99, show_default=True, help="Smallest mean cosine similarity, encoders.")
@click.option("--max-layer-error", type=float, help="Largest per-layer relative weight error [default: not checked].")
@click.option("--context-length", type=int, default=512, show_default=True, help="Tokens per evaluated sequence.")
@click.option("--max-tokens", type=int, default=8192, show_default=True, help="Most tokens of the text evaluated.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda (auto: a GPU when present).")
@click.option("--allow-pickle", is_flag=True, help="Allow a PyTorch .bin reference (loaded with weights_only=True).")
@click.option("--trust-remote-code", is_flag=True, help="Run the Python code the checkpoints ship for their model "
              "and tokenizer (auto_map); only for repositories you trust.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema: docs/verify.md).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar (shown only when stderr is a terminal).")
@click.option("-q", "--quiet", is_flag=True, help=QUIET_HELP)
def verify_command(packed, reference, no_reference, text_file, max_kl, min_top1, min_cosine, max_layer_error,
                   context_length, max_tokens, device, allow_pickle, trust_remote_code, as_json, no_progress, quiet):
    """Check a packed checkpoint's files and measure what quantization cost against the original.

    Integrity (checksums, index, shapes, dtypes, layout version), per-layer weight error, the
    kernels against float32, and both models on the same text (perplexity, KL, top-1 agreement;
    cosine similarity for encoders). Exit code 0: pass; 1: a check failed; 2: problems in the files.
    Several PACKED checkpoints of one source are each verified, then compared in one table (method,
    bits, group size, KL, top-1, perplexity ratio, worst layer error); the exit code is the worst.

    \b
    Examples:
      quantpack verify Llama-3.1-8B-qp4g128
      quantpack verify ./out --reference ./Llama-3.1-8B --text-file wiki.txt
      quantpack verify ./out-hqq ./out-sinq ./out-gptq --text-file wiki.txt
    """
    from .verify import verify

    if no_reference and reference:
        raise UsageFailure("--reference and --no-reference: pass one of them")
    if len(packed) > 1 and reference is None and not no_reference:
        _check_one_source(packed)
    reports = []
    for path in packed:
        try:
            reports.append(verify(path, reference=False if no_reference else reference, text_file=text_file,
                                  device=device, max_kl=max_kl, min_top1=min_top1, min_cosine=min_cosine,
                                  max_layer_error=max_layer_error, context_length=context_length,
                                  max_tokens=max_tokens, allow_pickle=allow_pickle,
                                  trust_remote_code=trust_remote_code,
                                  progress=_progress_wanted(no_progress, as_json, quiet)))
        except ValueError as e:  # bad input or an unavailable reference: already one line
            raise UsageFailure((f"{path}: " if len(packed) > 1 else "") + " ".join(str(e).split())) from None
    if len(reports) == 1:
        report = reports[0]
        if as_json or not quiet:
            (_echo_json if as_json else click.echo)(report.to_json() if as_json else report.format_table())
    elif as_json:
        from .verify.compare import comparison_rows

        _echo_json(json.dumps({"reports": [r.to_dict() for r in reports], "comparison": comparison_rows(reports)},
                              indent=2, allow_nan=False))
    elif not quiet:
        from .verify.compare import format_comparison

        click.echo(format_comparison(reports))
    several = len(reports) > 1
    for report in reports:
        _echo_warnings([f"{report.packed}: {w}" if several else w for w in report.warnings])
    corrupt = [r for r in reports if r.exit_code == 2]
    if corrupt:
        raise UsageFailure((f"{corrupt[0].packed}: " if several else "") + " ".join(corrupt[0].first_problem().split()))
    for report in reports:
        if report.exit_code == 1:
            failed = [c for c in report.checks if not c.passed]
            click.echo("Failed: " + (f"{report.packed}: " if several else "") + "; ".join(
                c.name if c.value is None or c.threshold is None else f"{c.name} = {c.value:.5g} (must be {c.op} {c.threshold:g})"
                for c in failed), err=True)
    if any(r.exit_code == 1 for r in reports):
        sys.exit(1)


def _check_one_source(packed) -> None:
    """Several checkpoints compared against their recorded sources must share one (else pass --reference)."""
    from pathlib import Path

    from .checkpoint import CheckpointError, read_manifest

    sources = {}
    for path in packed:
        try:
            source = (read_manifest(Path(path)) or {}).get("source") or {}
        except CheckpointError:
            continue  # verify reports it
        sources[path] = (source.get("repo"), source.get("revision"))
    items = list(sources.items())
    other = next((item for item in items if item[1] != items[0][1]), None)
    if other is not None:
        raise UsageFailure(f"{items[0][0]} and {other[0]} were converted from different sources ({items[0][1][0]} and "
                           f"{other[1][0]}); compare checkpoints of one source, or pass --reference SRC to compare "
                           f"all with it")


@cli.command("info", short_help="Show what a packed checkpoint is, without loading or verifying it.")
@click.argument("packed")
@click.option("--revision", help="Hub revision (branch, tag or commit) of PACKED.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def info_command(packed, revision, as_json):
    """Show a packed checkpoint's quantization settings, source, layers and size.

    Reads quantpack.json and config.json only: no tensor data is read and nothing is checked
    (`quantpack verify` does that).

    \b
    Examples:
      quantpack info Llama-3.1-8B-qp4g128
      quantpack info ./out --json
    """
    from .info import format_info, info

    try:
        doc = info(packed, revision=revision)
    except ValueError as e:
        raise UsageFailure(" ".join(str(e).split())) from None
    (_echo_json if as_json else click.echo)(json.dumps(doc, indent=2, allow_nan=False) if as_json else format_info(doc))
