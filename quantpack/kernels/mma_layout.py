"""The ``mma`` decode kernels' weight layout: the packed (K/2, N) weight reordered so that each lane of a warp reads
exactly its ``mma.sync.m16n8k16`` A fragments (see :mod:`quantpack.kernels.mma_gemv`), and back.

Dense layers keep this copy alongside the checkpoint's layout (kernels/caches.py) or, merged, alone
(kernels/merged_mm.py); mixture-of-experts blocks keep their experts in it alone (modules/experts.py), one
``(N/16, K/64, 32, 4)`` block per expert, and read the checkpoint's layout back with :func:`mma_unpack` where they
need it (prefill's dequantization, the state dict)."""
from __future__ import annotations

import torch

CHUNK = 64  # in-features per packed chunk (4 MMA k-steps)


def mma_pack(qweight: torch.Tensor, n: int, k: int, bits: int = 4) -> torch.Tensor:
    """The packed weight repacked for :func:`~quantpack.kernels.mma_gemv.launch_mma_gemv` (same byte count). 4-bit:
    the (..., K/2, N) uint8 layout (even k in the low nibble; leading dimensions, such as experts, kept) becomes
    (..., N/16, K/64, 32, 4) int32; 8-bit: the (K, N) layout becomes (N/8, K/64, 32, 4), tile 2t holding the high
    nibbles of rows 16t.. 16t + 15 and tile 2t + 1 their low nibbles. Needs N % 16 == 0 and K % 64 == 0."""
    if n % 16 or k % CHUNK:
        raise ValueError(f"mma layout needs N % 16 == 0 and K % {CHUNK} == 0, got N={n} K={k}")
    if bits == 8:
        planes = [qweight >> 4, qweight & 15]  # (K, N) each
        planes = [mma_pack(p[0::2] | (p[1::2] << 4), n, k) for p in planes]  # as 4-bit (K/2, N) weights
        return torch.stack(planes, dim=1).reshape(n // 8, k // CHUNK, 32, 4)
    # nibbles as uint8 (one byte per weight: this runs once per weight, possibly on a full GPU)
    lead = qweight.shape[:-2]
    d = len(lead)
    q = torch.stack([qweight & 15, qweight >> 4], dim=-2).reshape(*lead, k, n).transpose(-1, -2)  # q[.., n, k]
    # n = 16t + 8h + g, k = 64kc + 16c + 8kh + 2j + e  ->  word[t, kc, 4g + c, j], nibble at 4(h + 2kh) + 16e
    # (MMA row 2c + e + 8kh of k-step j is in-feature 16c + 8kh + 2j + e: each lane's first and
    # second B registers over a chunk are then 4 consecutive words of x each, one 16-byte load apiece)
    q = q.reshape(*lead, n // 16, 2, 8, k // CHUNK, 4, 2, 4, 2)  # (t, h, g, kc, c, kh, j, e)
    q = q.permute(*range(d), *(d + i for i in (0, 3, 2, 4, 6, 5, 1, 7))).reshape(-1, 4, 2)  # (.., t, kc, g, c, j)
    # x (r = h + 2kh) x e
    shift = 4 * torch.arange(4, device=q.device, dtype=torch.int32)
    lo = (q[..., 0].to(torch.int32) << shift).sum(-1, dtype=torch.int32)  # e = 0: bits 4r
    hi = (q[..., 1].to(torch.int32) << shift).sum(-1, dtype=torch.int32)  # e = 1: bits 16 + 4r
    words = lo.to(torch.int64) | (hi.to(torch.int64) << 16)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.reshape(*lead, n // 16, k // CHUNK, 32, 4).contiguous()


def mma_unpack(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of :func:`mma_pack` at 4 bits: ``(..., N/16, K/64, 32, 4)`` int32 words back to the
    ``(..., K/2, N)`` uint8 layout (leading dimensions, such as experts, kept)."""
    lead = words.shape[:-4]
    if tuple(words.shape[-4:]) != (n // 16, k // CHUNK, 32, 4) or n % 16 or k % CHUNK:
        raise ValueError(f"mma_unpack: words of shape {tuple(words.shape)} do not hold a 4-bit ({n}, {k}) matrix")
    w = words.to(torch.int64) & 0xFFFFFFFF
    shift = (4 * torch.arange(4, device=words.device)[:, None] + 16 * torch.arange(2, device=words.device)[None, :])
    q = ((w[..., None, None] >> shift) & 15).to(torch.uint8)  # (..., t, kc, lane, j, r, e)
    # lane = 4g + c and r = h + 2kh: (t, kc, g, c, j, kh, h, e) -> (t, h, g, kc, c, kh, j, e), as mma_pack read it
    q = q.reshape(*lead, n // 16, k // CHUNK, 8, 4, 4, 2, 2, 2)
    d = len(lead)
    q = q.permute(*range(d), *(d + i for i in (0, 6, 2, 1, 3, 5, 4, 7))).reshape(*lead, n, k)
    q = q.transpose(-1, -2)  # (..., K, N)
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).contiguous()
