"""quantpack's environment switches: the one place their values are parsed and checked (docs/environment.md).

A switch takes 1/0, true/false, on/off or yes/no (any case; unset or empty: its default); a few take one more word
(``QUANTPACK_W4A8=force``). Anything else is refused in one line naming the variable, rather than read as "on"."""
from __future__ import annotations

import os

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")
ACCEPTED = "1/0, true/false, on/off or yes/no"

# Every QUANTPACK_* switch: its default and the words it takes beyond on/off (docs/environment.md lists them).
SWITCHES = {
    "QUANTPACK_AUTOTUNE": (False, ()),
    "QUANTPACK_MMA": (True, ()),
    "QUANTPACK_WGMMA": (True, ()),
    "QUANTPACK_PDL": ("experts", ("experts",)),  # (unset: the mixture-of-experts decode launches only)
    "QUANTPACK_W4A8": (False, ("force",)),
    "QUANTPACK_LAUNCH_PLANS": (True, ()),
    "QUANTPACK_DECODE_ATTENTION": (True, ()),
    "QUANTPACK_TUNE_VERBOSE": (False, ()),
}


class EnvError(ValueError):
    """An environment variable quantpack reads holds a value it does not take."""


def parse_switch(name: str, value: str | bytes | None) -> bool | str:
    """``value`` (as read from the environment; ``None`` when unset) of the switch ``name``: True or False, or one
    of its extra words as written in :data:`SWITCHES`."""
    default, extra = SWITCHES[name]
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    word = (value or "").strip().lower()
    if not word:
        return default
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    if word in extra:
        return word
    accepted = ACCEPTED.replace(" or ", ", ") + "".join(f" or {w}" for w in extra) if extra else ACCEPTED
    said = default if isinstance(default, str) else "on" if default else "off"
    raise EnvError(f"{name}={value!r} is not a value it takes: use {accepted} (or unset it for the default, {said})")


def switch(name: str) -> bool | str:
    """The switch ``name`` as the environment sets it now."""
    return parse_switch(name, os.environ.get(name))


def check_environment() -> None:
    """Refuse any QUANTPACK_* switch set to a value it does not take (the command line checks before it starts),
    and a QUANTPACK_CACHE_DIR that names something other than a directory."""
    for name in SWITCHES:
        switch(name)
    cache = os.environ.get("QUANTPACK_CACHE_DIR")
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        raise EnvError(f"QUANTPACK_CACHE_DIR={cache!r} is not a directory: set it to a directory path (created if "
                       f"missing) or unset it for ~/.cache/quantpack")
