"""The integrity section of verify: the checks :func:`quantpack.load` runs (:mod:`quantpack.checkpoint.integrity`), every
problem reported; a changed file of a manifest without per-tensor digests is searched for the tensors that changed."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .. import checkpoint, schemes
from ..checkpoint import CheckpointError, TensorInfo
from ..checkpoint.experts import split_stacked_experts
from ..checkpoint.integrity import Checked, Problem, check_checkpoint, read_checked


# Quantized modules: each scheme says how its modules are checked (quantpack.schemes)


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every quantized layer by its checkpoint name; one expert's matrix of a stacked experts block as a
    ``QuantLinear`` over its slot (views, no copy)."""
    from ..modules.experts import ExpertMatrix
    from ..modules.linear import QuantLinear

    out = []
    for n, m in model.named_modules():
        if isinstance(m, ExpertMatrix):
            out.append((n, QuantLinear.from_packed(m.packed())))
        elif schemes.module_check(m) is not None:
            out.append((n, m))
    return out


# ----------------------------------------------------------------------------------------------
# Integrity


def check_integrity(root, *, reference: Path | None = None,
                    allow_pickle: bool = False, trust_remote_code: bool = False) -> tuple[dict, list[Problem], dict | None]:
    """Check a packed checkpoint's files with the checks :func:`quantpack.load` runs (:mod:`quantpack.checkpoint.integrity`),
    every tensor's data included, and report every problem rather than the first.

    Returns (summary counts, problems, validated quantization_config or None). With ``reference``
    (the source checkpoint directory), a file whose checksum differs and whose manifest records no per-tensor
    digests is searched for the tensors that changed (in a reference holding only PyTorch .bin weights when
    ``allow_pickle``). ``trust_remote_code``: let transformers run the checkpoint's own code to build its model
    (off: such a checkpoint is a config problem).
    """
    checked = check_checkpoint(root, verify=True, trust_remote_code=trust_remote_code)
    checked.problems += [problem for _, _, _, problem in read_checked(checked) if problem is not None]
    for fname in checked.changed_files:
        _name_changed_tensors(checked, fname, reference, allow_pickle)
    checked.sort()
    summary = {"files_checked": checked.files_checked, "tensors_checked": len(checked.tensors)}
    return summary, checked.problems, checked.qc


def _name_changed_tensors(checked: Checked, fname: str, reference: Path | None, allow_pickle: bool) -> None:
    """Replace the problem "file ``fname``: sha256 differs" (a manifest from before per-tensor digests) with the
    tensors that changed, where NaN or infinity, or the reference, tells which."""
    file_problem = next(p for p in checked.problems if p.kind == "checksum" and p.file == fname and p.tensor is None)
    nonfinite = [p for p in checked.problems if p.kind == "values" and p.file == fname]
    located = {p.tensor: "holds NaN or infinite values" for p in nonfinite}
    if reference is not None and checked.model is not None and not located:
        located = _locate_changes(checked.model, fname, checked.tensors, reference,
                                  (checked.manifest or {}).get("settings") or {}, allow_pickle=allow_pickle)
    if not located:
        if reference is None:
            file_problem.message += " (verify with a reference to find the tensor)"
        return
    checked.problems = [p for p in checked.problems if p is not file_problem and p not in nonfinite]
    for tname, why in located.items():
        checked.problems.append(Problem("checksum", f"tensor {tname} in {fname}: {why}; the file's sha256 differs from "
                                                    f"{checkpoint.MANIFEST_NAME}: it is corrupt or modified, download "
                                                    f"it again", file=fname, tensor=tname))


def reference_name(ref: checkpoint.SourceCheckpoint, name: str, prefix: str = "") -> str | None:
    """The reference tensor that holds checkpoint tensor ``name`` (names agree up to the base-model prefix)."""
    candidates = [name]
    if prefix:
        candidates += [f"{prefix}.{name}", name.removeprefix(prefix + ".")]
    return next((c for c in candidates if c in ref.tensors), None)


def _locate_changes(skeleton: nn.Module, fname: str, tensors: dict[str, TensorInfo], reference: Path,
                    settings: dict, *, allow_pickle: bool = False) -> dict[str, str]:
    """Tensors of shard ``fname`` that differ from what converting ``reference`` stores: other
    tensors bit for bit against the reference cast to the stored dtype, quantized modules by their
    scheme's ``locate``."""
    try:
        ref = split_stacked_experts(skeleton, checkpoint.SourceCheckpoint(reference, allow_pickle=allow_pickle))
    except CheckpointError:
        return {}

    def read(tname: str) -> torch.Tensor:
        return checkpoint.read_tensor(tensors[tname])

    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    located: dict[str, str] = {}
    try:
        modules = {}  # quantized module name -> its stored tensor names
        for name, module in quantized_modules(skeleton):
            names = [f"{name}.{k}" for k in module.state_dict(keep_vars=True)]
            if any(n in tensors and tensors[n].file.name == fname for n in names):
                modules[name] = (module, names)
        for tname, info in tensors.items():
            ref_name = reference_name(ref, tname, prefix) if info.file.name == fname else None
            if ref_name is None:  # packed tensors (qweight, scales...) have no reference namesake
                continue
            stored = read(tname)
            want = ref.get(ref_name)
            if want.is_floating_point() and stored.is_floating_point():
                want = want.to(stored.dtype)
            same = want.shape == stored.shape and want.dtype == stored.dtype and (
                not stored.numel() or torch.equal(want.reshape(-1).view(torch.uint8), stored.reshape(-1).view(torch.uint8)))
            if not same:
                located[tname] = "differs from the reference tensor it was converted from"
        for name, (module, names) in sorted(modules.items()):
            locate = schemes.module_check(module).locate
            ref_name = reference_name(ref, name + ".weight", prefix)
            if locate is None or ref_name is None or not all(n in tensors for n in names if not n.endswith(".bias")):
                continue
            try:
                found = locate(read, name, module, reference_weight(ref, ref_name, module), settings)
            except (CheckpointError, ValueError):
                continue
            located.update(dict(found))
    finally:
        ref.close()
    return located


def reference_weight(reference: checkpoint.SourceCheckpoint, ref_name: str, module: nn.Module) -> torch.Tensor:
    """The source weight of a quantized module as (out, in): GPT-2's Conv1D stored it (in, out)."""
    w = reference.get(ref_name)
    return w.t() if getattr(module, "source_transposed", False) else w
