"""Reading a checkpoint's ``config.json`` through transformers without ever running the checkpoint's code.

A repository can ship Python files that its ``config.json`` points at (``auto_map``); transformers runs
them only with ``trust_remote_code=True`` and otherwise, on a terminal, asks. quantpack always passes
the value explicitly (``False`` unless the user asked), so nothing prompts, and a config that cannot be
read without its own code is refused with one line naming the option.
"""
from __future__ import annotations

from pathlib import Path

from .checkpoint import CONFIG_NAME, CheckpointError, read_config

REMOTE_CODE_OPTION = "--trust-remote-code (trust_remote_code=True)"


def needs_remote_code(config: dict) -> bool:
    """Whether transformers can read ``config`` only by running the repository's own code: its
    ``model_type`` is one transformers does not know and ``auto_map`` names a config class."""
    from transformers import CONFIG_MAPPING

    auto_map = config.get("auto_map")
    return (config.get("model_type") not in CONFIG_MAPPING and isinstance(auto_map, dict)
            and "AutoConfig" in auto_map)


def check_remote_code(path, config: dict, *, trust_remote_code: bool = False) -> None:
    """Refuse (one line naming the option) a config that needs its repository's code, unless trusted."""
    if not trust_remote_code and needs_remote_code(config):
        raise CheckpointError(f"{Path(path) / CONFIG_NAME}: model_type {config.get('model_type')!r} needs the "
                              f"repository's own Python code (auto_map); pass {REMOTE_CODE_OPTION} to run it, "
                              f"if you trust it")


def auto_config(path, *, trust_remote_code: bool = False, config: dict | None = None):
    """``AutoConfig.from_pretrained(path)`` with ``trust_remote_code`` always given, after checking what
    transformers would refuse or ask about; every failure is a one-line :class:`CheckpointError`."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(path)
    config = read_config(path) if config is None else config
    model_type = config.get("model_type")
    where = path / CONFIG_NAME
    check_remote_code(path, config, trust_remote_code=trust_remote_code)
    if model_type is not None and model_type not in CONFIG_MAPPING and not needs_remote_code(config):
        raise CheckpointError(f"{where}: transformers {transformers.__version__} does not know model_type "
                              f"{model_type!r} and the checkpoint ships no code for it (no auto_map); a newer "
                              f"transformers may know it")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError, OSError, ImportError, StrictDataclassError) as e:
        # a field's type error comes on the lines after "Validation error for field ...": keep them
        first = " ".join(line.strip() for line in str(e).strip().splitlines()[:3]) or type(e).__name__
        raise CheckpointError(f"{where}: transformers {transformers.__version__} cannot read it "
                              f"({first[:200]})") from None


def model_class(config, *, trust_remote_code: bool = False):
    """The transformers class to build for ``config`` (an ``AutoConfig`` result): the first class
    ``architectures`` names that transformers has; with ``trust_remote_code``, the repository's own
    class from ``auto_map``; without ``architectures``, the Auto class's model for the model type.
    An ``architectures`` that names only classes transformers lacks is refused: building another
    class instead would rename or drop tensors."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    for arch in names:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type):
            return cls
    auto_map = getattr(config, "auto_map", None) or {}
    model_type = getattr(config, "model_type", None)
    auto = AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        "AutoModelForCausalLM" in auto_map and "AutoModel" not in auto_map) else AutoModel
    custom = auto_map.get(auto.__name__)
    if custom and trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(custom, config._name_or_path)
    if custom and type(config) in auto._model_mapping:  # as transformers does untrusted: its own class for the type
        return auto._model_mapping[type(config)]
    if custom and names:
        raise CheckpointError(f"config.json: architectures {names[0]!r} is the repository's own Python code "
                              f"(auto_map); pass {REMOTE_CODE_OPTION} to run it, if you trust it")
    if names:
        raise CheckpointError(f"config.json: architectures names {names[0]!r}, which transformers "
                              f"{transformers.__version__} does not have; a newer transformers may, or fix "
                              f"architectures in config.json")
    try:
        return auto._model_mapping[type(config)]
    except KeyError:
        raise CheckpointError(f"config.json: transformers {transformers.__version__} has no model class for "
                              f"model_type {model_type!r}") from None
