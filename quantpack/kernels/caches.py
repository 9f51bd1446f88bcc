"""State the fused matmul keeps between calls: the split-K arrival counters, the ``mma`` path's MMA-ordered weight
copies (built on first use of each weight tensor, checked once per device), and how tensors kept past a call are
allocated outside CUDA-graph memory pools."""
from __future__ import annotations

import threading
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import reference
from ..format import PackedWeight
from .dequant import cdiv, interpreting
from .mma_gemv import MAX_M as MMA_MAX_M, launch_mma_gemv, mma_grid
from .mma_layout import mma_pack


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter; -1 for an inference-mode tensor, which keeps none (or for what is not a tensor)."""
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return -1


# ----------------------------------------------------------------------------------------------
# split-K arrival counters: zero at rest (the last program of each tile resets its counter). Each
# launch takes the next slice of a per-device ring, so launches on concurrent streams (or baked into
# CUDA graphs) use disjoint counters unless 1M tiles of other launches run in between.

COUNTER_SLOTS = 1 << 20
_counters: dict = {}
_counters_lock = threading.Lock()


def counter_slice(device: torch.device, tiles: int) -> torch.Tensor:
    """``tiles`` counters of the device's ring, starting 16-byte aligned (as Triton specializes pointers: a launch
    plan replays a kernel compiled for an aligned slice)."""
    with _counters_lock:
        state = _counters.get(device)  # (keyed by the device itself: str(device) costs more than the rest of a call)
        if state is None:
            ring = outside_graph_pools(lambda: torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device), device)
            state = _counters[device] = [ring, 0]
        buf, offset = state
        if offset + tiles > COUNTER_SLOTS:
            offset = 0
        state[1] = offset + cdiv(tiles, 4) * 4
    return buf[offset:offset + tiles]


def counter_buffer(device: torch.device) -> torch.Tensor:
    """The whole counter ring of ``device`` (all zeros whenever no launch is in flight)."""
    counter_slice(device, 0)
    return _counters[device][0]



# ----------------------------------------------------------------------------------------------
# mma path: decode-ordered copies of 4-bit weights, built on first use of each weight tensor

mma_copies = WeakIdKeyDictionary()  # qweight -> (its version, its mma_pack copy), dropped with qweight
_mma_working: dict = {}  # device -> whether the compiled kernel passed its first-use check


def mma_self_check(device: torch.device) -> bool:
    """Run the mma kernel once on a small problem against the reference. Its correctness rests on
    Triton giving each lane one row of a (32 * warps, 4) tensor (true of every Triton it was tested
    with); if a compiler lays it out otherwise the path is switched off instead of computing garbage."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ok = _mma_working.get(str(device))
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        n, k, gs = 64, 256, 128
        s = (torch.rand(k // gs, n, device=device, generator=g) * 0.1 + 0.01).to(torch.bfloat16)
        x = torch.randn(MMA_MAX_M, k, device=device, generator=g).to(torch.bfloat16)
        out = torch.empty(MMA_MAX_M, n, dtype=torch.float32, device=device)
        try:
            ok = True
            # one and two 8-row halves of x, programs of one and of two 16-row blocks, one, two and four tiles
            # per warp, both ways of applying the zeros, 8-bit planes
            for bits, m, nt, rawq, blocks in ((4, 3, 1, True, 1), (4, 40, 2, True, 1), (4, 16, 2, False, 1),
                                              (4, 20, 4, True, 1), (4, 64, 4, False, 1),
                                              (4, MMA_MAX_M, 2, False, 2), (8, MMA_MAX_M, 1, True, 1)):
                qw = torch.randint(0, 256, (k * bits // 8, n), device=device, dtype=torch.uint8, generator=g)
                z = (torch.rand(k // gs, n, device=device, generator=g) * (2 ** bits - 1)).to(torch.bfloat16)
                w = reference.dequantize(PackedWeight(qw, s, z, bits, gs, 1, (n, k)), torch.float32)
                want = x[:m].float() @ w.t()
                grid = mma_grid(n, k, gs, 2, 1, nt, bits, blocks)
                launch_mma_gemv(x[:m], mma_pack(qw, n, k, bits), s, z, None, out, out, out, n=n, k=k, group_size=gs,
                                grid=grid, depth=2, rawq=rawq, use_asm=not interpreting(), bits=bits)
                ok &= bool(((out[:m] - want).norm() / want.norm()).item() < 1e-2)
        except Exception:  # noqa: BLE001  (a compiler that rejects the inline PTX: same outcome)
            ok = False
        if not ok:
            warnings.warn("quantpack: the tensor-core decode kernel (mma path) failed its self-check with this "
                          "Triton; decode falls back to the CUDA-core gemv path", RuntimeWarning, stacklevel=3)
        _mma_working[str(device)] = ok
    return ok


def mma_weight_copy(qweight: torch.Tensor, n: int, k: int, bits: int = 4) -> tuple[torch.Tensor | None, bool]:
    """The :func:`mma_pack` copy of ``qweight``, built on first use and kept while ``qweight`` lives
    (rebuilt if it is modified in place), and whether this call built it (then the kernels that wrote
    it may still be running: the launch that reads it must not use PDL); ``None`` where it cannot be
    used now: during CUDA-graph capture before it exists, or if the kernel failed its self-check."""
    try:
        version = qweight._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter (nor can it change outside one)
        version = -1
    hit = mma_copies.get(qweight)
    if hit is not None and hit[0] == version:
        return hit[1], False
    if qweight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, False
    if not mma_self_check(qweight.device):
        return None, False
    packed = outside_graph_pools(lambda: mma_pack(qweight, n, k, bits), qweight.device)
    mma_copies[qweight] = (version, packed)
    return packed, True


def outside_graph_pools(build, device: torch.device) -> torch.Tensor:
    """``build()`` for a tensor quantpack keeps past the call, allocated outside any CUDA-graph memory pool. The
    warm-up run of torch.compile's CUDA graphs (``mode="reduce-overhead"``, which transformers uses for a static
    cache) sends this thread's allocations to the graph's private pool and fails if one outlives the run ("tensor(s)
    in the cudagraph pool not tracked as outputs"). So the tensor is built by another thread, whose allocations do
    not go there, on its own stream, ordered after this stream's work and before its later work."""
    if device.type != "cuda":
        return build()
    if device.index is None:  # (the helper thread's current device is its own)
        device = torch.device("cuda", torch.cuda.current_device())
    current = torch.cuda.current_stream(device)
    ready = torch.cuda.Event()
    ready.record(current)
    result: dict = {}

    def work():
        try:
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device)
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    result["out"] = build()
                result["done"] = stream.record_event()
        except BaseException as exc:  # noqa: BLE001  (raised again in the caller's thread)
            result["error"] = exc

    worker = threading.Thread(target=work, name="quantpack-build")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    current.wait_event(result["done"])
    result["out"].record_stream(current)  # (freed later, its memory waits for this stream's work too)
    return result["out"]


