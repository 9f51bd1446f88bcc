"""Which kernel runs: the one decision behind every fused-matmul call, and why.

:func:`choose` takes the GPU as data (:class:`DeviceProps`: name, compute capability, SM count), the call's shape,
bits, dtype and layout, and the environment switches (:class:`Flags`), and returns a :class:`Decision`: the path
(``gemv``, ``mma``, ``wgmma``, ``fma``, ``dot``, ``dot_t`` or ``dq``; see mixed_mm.py), its config, whether it
launches with PDL, and the steps that led there. The steps, in order:

1. the config: forced by the caller, else the device's tuned table entry for (direction, bits, N, K, M bucket),
   else the nearest tuned entry (a borrowed ``wgmma`` tile shrunk where it would leave most SMs idle), else
   :func:`heuristic_config`;
2. clamped to what the call can run (:func:`fit_config`: no ``wgmma`` or ``mma`` transposed, ``gemv`` only for
   groups along K and at most :data:`GEMV_MAX_M` rows...);
3. ``wgmma`` only on Hopper with Gluon, QUANTPACK_WGMMA not 0 and a layout its TMA copies take, else the
   heuristic's pick without it; and not for a host-bound call (``host_bound``: at most :data:`HOST_BOUND_MAX_M` rows,
   not captured in a CUDA graph), which takes ``mma``: Triton's launcher builds ``wgmma``'s TMA descriptors in Python
   on every launch, and there the launch, not the kernel, is the call's time;
4. ``mma`` only with QUANTPACK_MMA not 0 and a layout it takes, else the CUDA-core GEMV (:func:`gemv_config`);
   with PDL where QUANTPACK_PDL=1, on Hopper or later, for at most :data:`PDL_MAX_M` rows.

:func:`explain` answers "what runs for this call, and why" in one paragraph. The launcher (mixed_mm.py) calls
:func:`choose` once per call shape (launch plans replay its outcome); what it decides at run time besides (the
``mma`` copy cannot be built under CUDA-graph capture, or its self-check failed) is :func:`without_mma`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..env import parse_switch
from .configs import KernelConfig, config_key, config_table, m_bucket, nearest, normalized_name
from .dequant import cdiv, interpreting
from .mma_gemv import MAX_M as MMA_MAX_M, mma_layout_fits
from .w4a8 import w4a8_config, w4a8_layout_fits
from .wgmma_mm import HAVE_GLUON, wgmma_layout_fits

__all__ = ["DeviceProps", "Flags", "Decision", "choose", "explain", "device_props", "MMA_MAX_M", "PDL_MAX_M",
           "experts_pdl", "WGMMA_MAX_M", "MERGE_MAX_M", "GEMV_MAX_M", "SMALL_M", "FUSED_MAX_M", "HOST_BOUND_MAX_M"]

# ----------------------------------------------------------------------------------------------
# thresholds (rows of x, M)

WGMMA_MAX_M = 4096  # up to which Hopper may run the wgmma kernel (the tuner still times dq + cuBLAS too)
PDL_MAX_M = 8  # up to which the mma path may launch with PDL (H200: M = 16 measured up to 10% slower)
MERGE_MAX_M = 16  # up to which sibling projections merge (modules/merged.py), where the stacked shape's tuned path is mma
# (on Hopper: every decode shape at M <= 8, q/k/v at 9-16 rows)
GEMV_MAX_M = 8  # up to which the CUDA-core GEMV runs (beyond, its config becomes the general CUDA-core tiles)
SMALL_M = 16  # heuristic: the tensor-core GEMV (forward) or 16-row tiles up to here; beyond, wgmma on Hopper
FUSED_MAX_M = 64  # heuristic off Hopper: fused tensor-core tiles up to here, dequantize + cuBLAS beyond (the fused
# large-M tiles lost to cuBLAS by 2-10x)
W4A8_MIN_M = 256  # from which the W4A8-FP8 path runs where QUANTPACK_W4A8=1 turns it on
W4A8_DEFAULT = "off"  # while QUANTPACK_W4A8 is unset: on an H100 it ran at 0.64-0.82x cuBLAS bf16, W4A16 at 0.91-1.17x
# (BENCHMARKS.md, "W4A8-FP8"; docs/kernels.md says why)
HOST_BOUND_MAX_M = 16  # up to which a call outside CUDA-graph capture takes the path with the cheaper launch (its host
# time, 30-70 us, exceeds any kernel's there)
DECODE_WAVES_M = 8  # heuristic: up to here, split-K until about 8 programs per SM (2 beyond): latency-bound GEMVs

_ENV_NAMES = ("QUANTPACK_MMA", "QUANTPACK_WGMMA", "QUANTPACK_PDL", "QUANTPACK_AUTOTUNE", "TRITON_INTERPRET",
              "QUANTPACK_W4A8", "QUANTPACK_LAUNCH_PLANS")
# (a planned call reads these: os.environ.get costs about 0.8 us a name, mostly the KeyError of an unset one, so they
# are looked up in CPython's dict behind os.environ, 0.05 us each, where there is one)
_ENVIRON = os.environ
_ENV_DATA = getattr(_ENVIRON, "_data", None)
_ENV_KEYS = (tuple(map(_ENVIRON.encodekey, _ENV_NAMES))
             if isinstance(_ENV_DATA, dict) and hasattr(_ENVIRON, "encodekey") else None)


def read_env() -> tuple:
    """The raw values (``None`` when unset; bytes where read from the dict behind os.environ) of QUANTPACK_MMA,
    QUANTPACK_WGMMA, QUANTPACK_PDL, QUANTPACK_AUTOTUNE, TRITON_INTERPRET, QUANTPACK_W4A8 and QUANTPACK_LAUNCH_PLANS:
    every switch a call's decisions read (part of a launch plan's key)."""
    if _ENV_KEYS is not None and os.environ is _ENVIRON:
        return tuple(map(_ENV_DATA.get, _ENV_KEYS))
    return tuple(map(os.environ.get, _ENV_NAMES))


def launch_plans_enabled(env: tuple | None = None) -> bool:
    """Whether ``mixed_mm(plans=...)`` records and replays launch plans (``QUANTPACK_LAUNCH_PLANS=0`` turns them off:
    every call then does its host-side work again, as without a PlanCache). ``env``: :func:`read_env`'s values."""
    return Flags.from_env(env).launch_plans


@dataclass(frozen=True)
class Flags:
    """The environment switches a decision reads (parsed by quantpack.env): ``mma`` (QUANTPACK_MMA, on by default),
    ``wgmma`` (QUANTPACK_WGMMA, on), ``pdl`` (QUANTPACK_PDL: True, False, or ``"experts"`` while unset: see
    :func:`pdl_device` and :func:`experts_pdl`), ``interpret`` (TRITON_INTERPRET set: Triton's
    CPU interpreter), ``w4a8`` (QUANTPACK_W4A8: ``"on"``, ``"off"`` or ``"force"``; :data:`W4A8_DEFAULT` while
    unset), ``autotune`` (QUANTPACK_AUTOTUNE, off) and ``launch_plans`` (QUANTPACK_LAUNCH_PLANS, on)."""

    mma: bool = True
    wgmma: bool = True
    pdl: bool | str = "experts"
    interpret: bool = False
    w4a8: str = W4A8_DEFAULT
    autotune: bool = False
    launch_plans: bool = True

    @classmethod
    def from_env(cls, env: tuple | None = None) -> "Flags":
        """The switches as the environment (or ``env``, :func:`read_env`'s values) sets them now (parsed once per
        set of raw values; a value a switch does not take raises :class:`quantpack.env.EnvError`)."""
        env = env if env is not None else read_env()
        flags = _flags.get(env)
        if flags is None:
            mma, wgmma, pdl, autotune, interpret, w4a8, plans = env
            interpret = interpret.decode() if isinstance(interpret, bytes) else interpret
            flags = _flags[env] = cls(mma=parse_switch("QUANTPACK_MMA", mma),
                                      wgmma=parse_switch("QUANTPACK_WGMMA", wgmma),
                                      pdl=parse_switch("QUANTPACK_PDL", pdl),
                                      interpret=(interpret or "0") not in ("", "0"), w4a8=w4a8_mode(w4a8),
                                      autotune=parse_switch("QUANTPACK_AUTOTUNE", autotune),
                                      launch_plans=parse_switch("QUANTPACK_LAUNCH_PLANS", plans))
        return flags


_flags: dict = {}


def w4a8_mode(value: str | bytes | None) -> str:
    """QUANTPACK_W4A8's value as a :attr:`Flags.w4a8` mode."""
    mode = parse_switch("QUANTPACK_W4A8", value)
    if value is None or value in ("", b""):
        return W4A8_DEFAULT
    return mode if isinstance(mode, str) else "on" if mode else "off"


def w4a8_forced(env: tuple | None = None) -> bool:
    """Whether QUANTPACK_W4A8=force: every forward call of a weight the W4A8 path takes runs it (the CPU reference
    path too, with the same FP8 activation rounding: to measure its quality anywhere)."""
    return Flags.from_env(env).w4a8 == "force"


def w4a8_reference(n: int, k: int, group_size: int, bits: int, axis: int, transposed: bool = False) -> bool:
    """Whether a call off the GPU computes with the W4A8 path's FP8-rounded activations (QUANTPACK_W4A8=force and a
    forward call of a weight that path takes): the one rule for every reference fallback."""
    return not transposed and w4a8_forced() and w4a8_layout_fits(n, k, group_size, bits, axis)


@dataclass(frozen=True)
class DeviceProps:
    """What a decision needs to know of a device: ``name`` (as ``torch.cuda.get_device_name``), compute
    ``capability`` (major, minor), ``sms`` (streaming multiprocessors); ``gpu=False`` for Triton's CPU interpreter."""

    name: str
    capability: tuple[int, int] | None
    sms: int
    gpu: bool = True

    @property
    def key(self) -> str:
        """The stem of the device's config table (configs/<key>.json)."""
        return normalized_name(self.name)


INTERPRETER = DeviceProps("interpreter", None, 8, gpu=False)
_props: dict = {}


def device_props(device: torch.device) -> DeviceProps:
    """The :class:`DeviceProps` of ``device`` (looked up once per GPU); :data:`INTERPRETER` off a GPU."""
    if device.type != "cuda":
        return INTERPRETER
    index = torch.cuda.current_device() if device.index is None else device.index
    props = _props.get(index)
    if props is None:
        p = torch.cuda.get_device_properties(index)
        props = _props[index] = DeviceProps(torch.cuda.get_device_name(index), (p.major, p.minor),
                                            p.multi_processor_count)
    return props


def wgmma_device(props: DeviceProps, flags: Flags) -> bool:
    """Whether the device can run the wgmma kernel: a Hopper GPU (9.x), Gluon in this Triton, not under the
    interpreter, and not turned off with QUANTPACK_WGMMA=0."""
    return (HAVE_GLUON and props.gpu and not flags.interpret and flags.wgmma and props.capability is not None
            and props.capability[0] == 9)


def w4a8_device(props: DeviceProps, flags: Flags) -> bool:
    """Whether the device has the FP8 tensor cores the W4A8 path uses: compute capability 9.0 or newer (Hopper,
    Blackwell). Triton's CPU interpreter runs it too (exactly, in float32), but takes it only where forced."""
    if not props.gpu or flags.interpret:
        return True
    return props.capability is not None and tuple(props.capability) >= (9, 0)


def w4a8_pick(props: DeviceProps, flags: Flags, m: int, n: int, k: int, bits: int, axis: int, group_size: int,
              transposed: bool) -> tuple[bool, tuple | None]:
    """Whether a call runs the W4A8-FP8 path, and the step that says why (or why not; ``None`` where the path does
    not concern the call: transposed, or not 4-bit)."""
    if transposed or bits != 4:
        return False, None
    if flags.w4a8 == "off":
        return False, ("no_w4a8", "QUANTPACK_W4A8 is off (the default: slower than the 16-bit paths on an "
                                  "H100; 1 turns it on)")
    if not w4a8_device(props, flags):
        return False, ("no_w4a8", f"the GPU has no FP8 tensor cores (capability {props.capability} < (9, 0))")
    if not w4a8_layout_fits(n, k, group_size, bits, axis):
        return False, ("no_w4a8", f"its layout does not fit it (axis {axis}, group size {group_size}; it takes groups "
                       "along K of a power of two >= 64)")
    if flags.w4a8 != "force":
        if not props.gpu or flags.interpret:
            return False, ("no_w4a8", "not on a GPU (QUANTPACK_W4A8=force runs it in the interpreter)")
        if m < W4A8_MIN_M:
            return False, ("no_w4a8", f"M={m} < {W4A8_MIN_M}")
    return True, ("w4a8", m, flags.w4a8)


def w4a8_runs(m: int, n: int, k: int, bits: int, group_size: int, axis: int, device: torch.device) -> bool:
    """Whether a forward call of ``m`` rows through this weight on ``device`` rounds its activations to FP8: it runs
    the W4A8 path (a GPU, or the interpreter where forced), or the CPU reference where QUANTPACK_W4A8=force. (What
    verify's kernel check compares a layer with.)"""
    flags = Flags.from_env()
    if device.type != "cuda" and not flags.interpret:
        return flags.w4a8 == "force" and w4a8_layout_fits(n, k, group_size, bits, axis)
    return w4a8_pick(device_props(device), flags, m, n, k, bits, axis, group_size, False)[0]


def pdl_device(props: DeviceProps, flags: Flags) -> bool:
    """Whether the dense decode kernels launch with programmatic dependent launch (Hopper and later): each starts
    while the kernel before it finishes, waiting only before it reads anything another kernel may write. Off unless
    QUANTPACK_PDL=1: on an H200 it made back-to-back M = 1 calls 8-17% faster, but M = 4/8 and 8-bit 4096^2 calls
    3-9% slower and 8B-shaped graph decode no faster."""
    return flags.pdl is True and _pdl_capable(props, flags)


def experts_pdl(props: DeviceProps, flags: Flags) -> bool:
    """Whether a mixture-of-experts decode block of one block per (token, slot) pair chains its three launches with
    PDL (Hopper and later): the activation's grid starts while gate_up finishes, down's loads its experts' weights
    while the activation runs. On unless QUANTPACK_PDL=0 (H200: Qwen3-30B-A3B's batch-1 block 17.0 -> 14.9 us, two
    tokens 22.3 -> 21.4; Mixtral's unchanged)."""
    return flags.pdl is not False and _pdl_capable(props, flags)


def _pdl_capable(props: DeviceProps, flags: Flags) -> bool:
    """A GPU of compute capability 9.0 or later (Hopper, Blackwell), not Triton's interpreter: where PDL exists."""
    return props.gpu and not flags.interpret and props.capability is not None and props.capability[0] >= 9


# ----------------------------------------------------------------------------------------------
# configs without a table entry


def fill_split(tiles: int, reduce_steps: int, sms: int, waves: float = 2.0) -> int:
    """Smallest power-of-two split that gives about ``waves`` programs per SM (bounded by the work)."""
    split = 1
    while tiles * split < waves * sms and split * 2 <= reduce_steps and split < 64:
        split *= 2
    return split


def gemv_config(m: int, n: int, k: int, sms: int) -> KernelConfig:
    """The CUDA-core GEMV as tuning picked it on an H200 at M = 1: 1-warp programs, ~8 per SM."""
    return KernelConfig(path="gemv", block_m=1, block_n=128, block_r=32, num_warps=1, words=n % 4 == 0,
                        split=fill_split(m * cdiv(n, 128), cdiv((k + 1) // 2, 32), sms, 8.0))


def heuristic_config(transposed: bool, m: int, n: int, k: int, props: DeviceProps, flags: Flags = Flags(),
                     wgmma: bool = True) -> KernelConfig:
    """A config without tuning, following what tuning chose on an H200: the tensor-core GEMV for M <= 16 (the
    CUDA-core one where its layout needs are not met; tuned tables take it up to M = 64), split tensor-core tiles up
    to M = 64, dequantize + cuBLAS beyond (the fused large-M kernels lost to it by 2-10x there); on Hopper
    (``wgmma``) the asynchronous warpgroup-MMA kernel, with its producer warp, for 17-4096 rows."""
    sms = props.sms
    kh = (k + 1) // 2
    if wgmma and not transposed and SMALL_M < m <= WGMMA_MAX_M and wgmma_device(props, flags):
        # the shapes of the H200 table: one 64-row weight tile per program up to 256 rows of x, split until the
        # tiles fill the GPU
        bm = min(256, max(32, m_bucket(m)))
        bn = 64 if bm <= 128 else 128
        tiles = cdiv(m, bm) * cdiv(n, bn)
        return KernelConfig("wgmma", block_m=bm, block_n=bn, block_r=64 if bm <= 128 else 32, num_warps=bn // 16,
                            num_stages=4, split=min(4, fill_split(tiles, max(1, k // 128), sms, 1.0)),
                            producer=True)
    if m > FUSED_MAX_M and props.gpu:
        return KernelConfig(path="dq")
    if m <= SMALL_M and not transposed:
        # 2-warp programs, ~8 per SM (mma_grid rounds the split to a divisor of the group count)
        return KernelConfig(path="mma", block_m=max(8, m_bucket(m)), block_n=16, num_warps=2, num_stages=2,
                            split=fill_split(max(1, n // 32), max(1, k // 64), sms, 8.0))
    if transposed:
        bm = 16 if m <= SMALL_M else (64 if m <= FUSED_MAX_M else 128)
        cfg = KernelConfig(path="dot", block_m=bm, block_n=64, block_r=64 if m > FUSED_MAX_M else 32,
                           num_warps=8 if m > FUSED_MAX_M else 4, num_stages=3)
        tiles = cdiv(m, bm) * cdiv(kh, cfg.block_r)
        reduce_steps = cdiv(n, cfg.block_n)
    elif m <= FUSED_MAX_M:
        cfg = KernelConfig(path="dot", block_m=max(16, m_bucket(m)), block_n=64, block_r=64, num_warps=4,
                           num_stages=3)
        tiles = cdiv(m, cfg.block_m) * cdiv(n, 64)
        reduce_steps = cdiv(kh, 64)
    else:
        cfg = KernelConfig(path="dot", block_m=128, block_n=128, block_r=32, num_warps=8, num_stages=3)
        tiles = cdiv(m, 128) * cdiv(n, 128)
        reduce_steps = cdiv(kh, 32)
    return replace(cfg, split=fill_split(tiles, reduce_steps, sms, 8.0 if m <= DECODE_WAVES_M else 2.0))


def smaller_tiles(cfg: KernelConfig, m: int, n: int, sms: int) -> KernelConfig:
    """A ``wgmma`` config borrowed from another shape (:func:`~quantpack.kernels.configs.nearest`) whose tiles leave
    more than half the SMs idle on this one, with smaller tiles: 64 weight rows instead of 128, then 128 rows of x
    instead of 256, while its programs number under half the SMs. Its split is kept: raising it measured up to 1.7x
    slower at K = 2048-3072. On an H100 this took 1024 x 8192 at M = 1024 from 75.6 to 33.2 us (the tuned pick) and
    2048^2 at M = 1024 from 23.1 to 15.9; where the borrowed tiles filled half the SMs, shrinking them measured
    slower, and is not done."""
    if cfg.path != "wgmma" or cfg.rawq:
        return cfg

    def programs(c):
        return cdiv(m, c.block_m) * cdiv(n, c.block_n) * c.split

    if programs(cfg) < sms // 2 and cfg.block_n > 64:
        cfg = replace(cfg, block_n=64, num_warps=4)
    if programs(cfg) < sms // 2 and cfg.block_m > 128:  # (x's ring: 128-row tiles take 64 pair rows per K step)
        cfg = replace(cfg, block_m=128, block_r=64)
    return cfg


def table_pick(props: DeviceProps, flags: Flags, transposed: bool, bits: int, m: int, n: int, k: int
               ) -> tuple[KernelConfig, tuple]:
    """The device table's config for this key, else the nearest tuned one (tiles shrunk where borrowed ones would
    leave most SMs idle), else the heuristic; and where it came from (a step of :attr:`Decision.steps`)."""
    table = config_table(props.key, props.capability)
    key = config_key(transposed, bits, n, k, m)
    cfg = table.get(key)
    if cfg is not None:
        return cfg, ("table", props.key, key)
    cfg = nearest(table, transposed, bits, n, k, m)
    if cfg is not None:
        shrunk = smaller_tiles(cfg, m, n, props.sms)
        return shrunk, ("nearest", props.key, key, shrunk != cfg)
    return heuristic_config(transposed, m, n, k, props, flags), ("heuristic", props.key, key)


def pick_config(transposed: bool, bits: int, m: int, n: int, k: int, device: torch.device) -> KernelConfig:
    """Tuned config for this key if shipped (or autotuned in this process), else the nearest tuned one, else the
    heuristic (:func:`table_pick` for ``device`` as the environment sets the switches now). Never times anything."""
    return table_pick(device_props(device), Flags.from_env(), transposed, bits, m, n, k)[0]


def fit_config(cfg: KernelConfig, transposed: bool, m: int, axis: int, group_size: int) -> KernelConfig:
    """Clamp a (possibly nearest-shape) config to what this call can run (the mma path's layout needs are checked
    in :func:`choose`)."""
    if cfg.path == "wgmma" and transposed:
        cfg = KernelConfig("dot", block_m=16 if m <= SMALL_M else 64, block_n=64, block_r=64, split=cfg.split,
                           num_stages=3)
    if cfg.path == "mma" and (transposed or m > MMA_MAX_M):
        cfg = KernelConfig("dot", block_m=16, block_n=64, block_r=64, split=cfg.split, num_stages=3)
    if cfg.path == "gemv" and (transposed or axis != 1 or group_size % (2 * cfg.block_r) or m > GEMV_MAX_M):
        cfg = replace(cfg, path="fma", words=False)  # the general CUDA-core tiles
    if transposed and cfg.path == "fma":
        cfg = replace(cfg, path="dot")
    if cfg.path == "fma":  # GEMV tiles cover all of M (at most 8 rows each)
        cfg = replace(cfg, block_m=min(m_bucket(m), GEMV_MAX_M))
    if cfg.path in ("dot", "dot_t"):
        cfg = replace(cfg, block_m=max(16, cfg.block_m), block_r=max(16, cfg.block_r))
    return cfg


def without_wgmma(props: DeviceProps, flags: Flags, transposed: bool, m: int, n: int, k: int, axis: int,
                  group_size: int) -> KernelConfig:
    """The config a call runs where the table's pick is ``wgmma`` but ``wgmma`` cannot run it."""
    return fit_config(heuristic_config(transposed, m, n, k, props, flags, wgmma=False), transposed, m, axis,
                      group_size)


def without_mma(props: DeviceProps, transposed: bool, m: int, n: int, k: int, axis: int, group_size: int
                ) -> KernelConfig:
    """The config a call runs where the pick is ``mma`` but ``mma`` cannot run it: the CUDA-core GEMV (or what
    :func:`fit_config` makes of it)."""
    return fit_config(gemv_config(m, n, k, props.sms), transposed, m, axis, group_size)


# ----------------------------------------------------------------------------------------------
# the decision


@dataclass(frozen=True)
class Decision:
    """What :func:`choose` decided: the ``config`` (its ``path`` is the kernel), whether it launches with ``pdl``,
    and the ``steps`` that led there (:attr:`reason` words them)."""

    config: KernelConfig
    pdl: bool = False
    steps: tuple = ()

    @property
    def path(self) -> str:
        return self.config.path

    @property
    def reason(self) -> str:
        return "; ".join(filter(None, map(_say, self.steps)))


def _fits(value) -> bool:
    """A layout check given as a bool, or as a callable evaluated only where the decision needs it."""
    return value() if callable(value) else bool(value)


def choose(props: DeviceProps, m: int, n: int, k: int, bits: int, dtype: torch.dtype, *, axis: int = 1,
           group_size: int = 128, transposed: bool = False, flags: Flags = Flags(),
           config: KernelConfig | None = None, mma_fits=None, wgmma_fits=None, host_bound: bool = False) -> Decision:
    """The kernel and config a call of ``m`` rows of x (``dtype``) through a packed (``n``, ``k``) weight of ``bits``
    (``axis``, ``group_size``) runs on ``props``'s device with the switches ``flags`` (see the module docstring for
    the steps). ``config`` forces one (it is still clamped). ``mma_fits`` / ``wgmma_fits``: whether the call's
    tensors fit those kernels (a bool, or a callable asked only where needed); by default, whether tensors of these
    shapes do when aligned and contiguous. The ``mma`` weight copy is assumed to exist (:func:`without_mma` is what
    runs while it cannot). ``host_bound``: the call is not captured in a CUDA graph, so its host time counts (eager
    calls; a captured one is replayed without it)."""
    w4a8, w4a8_step = w4a8_pick(props, flags, m, n, k, bits, axis, group_size, transposed)
    if config is not None and config.path == "w4a8":  # (given: runs at any M and mode, where it can)
        if not transposed and w4a8_device(props, flags) and w4a8_layout_fits(n, k, group_size, bits, axis):
            return Decision(config, False, (("forced",),))
        config, w4a8 = None, False  # (a call it cannot run: as if none was given)
    if config is not None:
        steps = [("forced",)]
    else:
        if w4a8:
            return Decision(w4a8_config(wgmma_device(props, flags), m, n, props.sms), False, (w4a8_step,))
        config, source = table_pick(props, flags, transposed, bits, m, n, k)
        steps = [source] + ([w4a8_step] if w4a8_step is not None else [])
    fitted = fit_config(config, transposed, m, axis, group_size)
    if fitted != config:
        steps.append(("fitted", config.path, fitted.path, transposed, m, axis, group_size))
    config = fitted
    if host_bound and config.path == "wgmma" and steps[0] != ("forced",) and m <= HOST_BOUND_MAX_M:
        config = fit_config(heuristic_config(transposed, m, n, k, props, flags, wgmma=False), transposed, m, axis,
                            group_size)
        steps.append(("host_bound", m, config.path))
    if config.path == "wgmma":
        ok = wgmma_device(props, flags)
        if ok:
            ok = _fits(wgmma_fits) if wgmma_fits is not None else wgmma_layout_fits(n, k, group_size, bits, axis,
                                                                                     dtype)
        if not ok:
            config = without_wgmma(props, flags, transposed, m, n, k, axis, group_size)
            steps.append(("no_wgmma", props, flags, config.path))
        else:
            steps.append(("wgmma", props, flags))
    pdl = False
    if config.path == "mma":
        ok = flags.mma and (_fits(mma_fits) if mma_fits is not None
                            else mma_layout_fits(m, n, k, group_size, bits, axis, dtype))
        if ok:
            pdl = m <= PDL_MAX_M and pdl_device(props, flags)
            steps.append(("pdl", m, pdl, flags.pdl is True))
        else:
            config = without_mma(props, transposed, m, n, k, axis, group_size)
            steps.append(("no_mma", flags.mma, config.path))
    return Decision(config, pdl, tuple(steps))


def mma_decision(m: int, n: int, k: int, group_size: int, bits: int, device: torch.device, host_bound: bool = False
                 ) -> Decision | None:
    """The :class:`Decision` of a forward call of ``m`` rows of x (16-bit, laid out as the mma path needs) on
    ``device`` where it runs the ``mma`` path, else ``None`` (merged_mm.py asks). ``host_bound`` as in
    :func:`choose`."""
    flags = Flags.from_env()
    if not (1 <= m <= MMA_MAX_M and flags.mma and (device.type == "cuda" or interpreting())):
        return None
    decision = choose(device_props(device), m, n, k, bits, torch.bfloat16, group_size=group_size, flags=flags,
                      mma_fits=True, wgmma_fits=True, host_bound=host_bound)
    return decision if decision.path == "mma" else None


def mma_config(m: int, n: int, k: int, group_size: int, bits: int, device: torch.device, host_bound: bool = False
               ) -> KernelConfig | None:
    """The ``mma`` config of :func:`mma_decision`, or ``None`` where the call runs another path."""
    decision = mma_decision(m, n, k, group_size, bits, device, host_bound)
    return decision.config if decision is not None else None


# ----------------------------------------------------------------------------------------------
# explaining a decision

PATH_NAMES = {
    "gemv": "the CUDA-core GEMV (gemv.py)",
    "mma": "the tensor-core GEMV on the weight's MMA-ordered copy (mma_gemv.py)",
    "wgmma": "the Hopper warpgroup-MMA kernel (wgmma_mm.py)",
    "fma": "the CUDA-core tiles (mixed_mm.py, fma)",
    "dot": "the tensor-core tiles (mixed_mm.py, dot)",
    "dot_t": "the transposed tensor-core tiles, C^T = W x^T (mixed_mm.py, dot_t)",
    "dq": "dequantize + cuBLAS",
    "w4a8": ("the W4A8-FP8 kernel: activations quantized per token to FP8 e4m3, FP8 tensor cores (w4a8.py; on Hopper "
             "w4a8_wgmma.py)"),
}


def _say(step: tuple) -> str:
    what = step[0]
    if what == "forced":
        return "the config was given by the caller"
    if what == "table":
        return f"the {step[1]} config table has an entry for {step[2]}"
    if what == "nearest":
        return (f"the {step[1]} config table has no entry for {step[2]}, so it takes the nearest tuned one"
                + (" with smaller tiles (the borrowed ones would leave most SMs idle)" if step[3] else ""))
    if what == "heuristic":
        return f"the {step[1]} config table has nothing near {step[2]}, so the heuristic picks it"
    if what == "fitted":
        _, before, after, transposed, m, axis, group_size = step
        if before == after:
            return None
        return (f"the pick was {before}, which cannot run this call ({'transposed, ' if transposed else ''}M={m}, "
                f"axis={axis}, group size {group_size}), so {after}")
    if what == "wgmma":
        return "the GPU is Hopper and QUANTPACK_WGMMA is not 0"
    if what == "w4a8":
        m, mode = step[1:]
        if mode == "force":
            return "QUANTPACK_W4A8=force"
        return f"QUANTPACK_W4A8=1, the GPU has FP8 tensor cores and M={m} >= {W4A8_MIN_M}"
    if what == "no_w4a8":
        return f"not the W4A8-FP8 path: {step[1]}"
    if what == "host_bound":
        m, after = step[1:]
        return (f"the call is not captured in a CUDA graph and M={m} <= {HOST_BOUND_MAX_M}, so its launch's host time "
                f"outweighs the kernel's: {after}, whose launch builds no TMA descriptors, instead of wgmma")
    if what == "no_wgmma":
        props, flags, after = step[1:]
        cause = ("QUANTPACK_WGMMA=0" if not flags.wgmma else "this Triton has no Gluon" if not HAVE_GLUON
                 else "not on a GPU" if not props.gpu or flags.interpret
                 else f"the GPU is not Hopper (capability {props.capability})" if props.capability is None
                 or props.capability[0] != 9 else "the call's layout does not fit it")
        return f"the pick was wgmma, but {cause}, so the heuristic's {after}"
    if what == "no_mma":
        enabled, after = step[1:]
        cause = "QUANTPACK_MMA=0" if not enabled else "the call's layout does not fit it"
        return f"the pick was mma, but {cause}, so {after}"
    if what == "pdl":
        m, pdl, flag = step[1:]
        if pdl:
            return f"it launches with PDL (QUANTPACK_PDL=1, M={m} <= {PDL_MAX_M}, Hopper or later)"
        return None if not flag else f"no PDL (M={m} > {PDL_MAX_M}, or the GPU is older than Hopper)"
    return str(step)


def explain(m: int, n: int, k: int, bits: int = 4, group_size: int = 128, dtype: torch.dtype = torch.bfloat16,
            device: torch.device | str | DeviceProps | None = None, *, transposed: bool = False, axis: int = 1,
            flags: Flags | None = None, captured: bool = False) -> str:
    """One paragraph: which kernel and config a fused-matmul call of ``m`` rows (``x @ W.T``, or ``x @ W`` with
    ``transposed``) through a packed (``n``, ``k``) weight runs on ``device`` (default: the current GPU; a
    :class:`DeviceProps` to ask about another one), and why. ``flags``: the environment switches (default: as set
    now); ``captured``: for a call captured in a CUDA graph (the default decode path) rather than an eager one.
    Assumes aligned, contiguous tensors and the default config tables plus what was autotuned here."""
    flags = flags if flags is not None else Flags.from_env()
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, DeviceProps):
        props = device
    else:
        device = torch.device(device)
        if device.type != "cuda" and not (device.type == "cpu" and flags.interpret):
            return (f"On {device}, without TRITON_INTERPRET, no Triton kernel runs: the pure-torch reference computes "
                    f"the product (M={m}, N={n}, K={k}, {bits}-bit).")
        props = device_props(device)
    d = choose(props, m, n, k, bits, dtype, axis=axis, group_size=group_size, transposed=transposed, flags=flags,
               host_bound=not captured)
    where = props.name if props.gpu else "Triton's CPU interpreter"
    shape = (f"{'x @ W' if transposed else 'x @ W.T'} with M={m}, N={n}, K={k}, {bits}-bit, group size {group_size}, "
             f"axis {axis}, {str(dtype).replace('torch.', '')}")
    return f"On {where}, {shape} runs {PATH_NAMES[d.path]} with {d.config}, because {d.reason}."
