"""End-to-end decode speed of a Llama-3.1-8B-shaped model: bf16 vs quantpack 4-bit, on one GPU.

The model has random weights and is built directly on the GPU; the quantized variant is made in
memory (every decoder linear -> QuantLinear, lm_head kept in bf16, as ``quantpack convert`` does),
so no 16 GB files are involved. Decode tokens/s = batch * tokens / time of the decode steps
(prefill excluded), measured two ways:

* ``default``: plain ``model.generate(prompt, max_new_tokens=N)`` on the model as ``quantpack.load`` returns it:
  a static KV cache and each decode step replayed from a CUDA graph (quantpack.generation). What a user gets.
* ``eager``: transformers' ``generate`` (dynamic cache), what bf16 gives out of the box and ``decode="eager"`` opts into;
  bound by the host's Python, whose speed drifts by more than the models differ: bf16 (built again after quantizing) and
  each quantized model are timed in alternating rounds (``--eager-rounds``), tok/s from the median step time over
  all rounds, and the ratio is the median of the rounds' ratios. ``--no-plans`` also times the quantized model
  with its launch plans off (``QUANTPACK_LAUNCH_PLANS=0``), the cost those plans save.
* ``graph``: one greedy decode step with a static KV cache captured in a CUDA graph and replayed,
  which removes that overhead and shows what the weights' memory traffic costs.
* ``compiled``: ``generate(..., cache_implementation="static")``, for which transformers compiles the decode step
  itself (torch.compile, inductor, ``mode="reduce-overhead"``: CUDA graphs); the fused kernels enter that graph as
  the custom op ``torch.ops.quantpack.mixed_mm``. The one-line way to decode fast. The first call's compile time
  is reported too.

The quantized model is measured twice: each layer alone, then with each block's q/k/v and gate/up merged into one
decode GEMV (``merge_projections``, which ``quantpack.load`` applies; ``--no-merged`` skips it).

It also checks the fused kernel's logits against quantpack's reference path on the same packed
weights. Prints a table and writes JSON (``--json``).

    python benchmarks/bench_decode.py                          # 8B shape, batch 1 and 16
    python benchmarks/bench_decode.py --layers 4 --new-tokens 32   # quick look
    python benchmarks/bench_decode.py --modes compiled graph       # skip the eager timings
    python benchmarks/bench_decode.py --modes default graph --lm-head-bits 8 4   # + lm_head quantized too
    python benchmarks/bench_decode.py --profile                    # + where a decode step's GPU time goes
    python benchmarks/bench_decode.py --model qwen3-moe            # Qwen3-30B-A3B's shape (128 experts, top-8)
    python benchmarks/bench_decode.py --model mixtral --modes default graph compiled   # Mixtral-8x7B's shape

The mixture-of-experts presets quantize each expert's matrices with ``--method`` on the GPU as convert does
(``QuantExperts.from_experts``) and keep the routers in bf16; rows carry ``shape.experts`` and ``shape.top_k``.

Long context: ``--context 4096 32768`` prefills a prompt of that many tokens before the timed decode steps (``0``:
the short ``--prompt-len`` prompt); each (batch, context) cell runs unless batch x context exceeds
``--max-kv-tokens`` (default 65,536: batch 1 to 32k, batch 16 to 4k on an 8B shape, whose bf16 KV cache takes
128 KiB a token). ``--ttft-prompt`` (default 2048) also times the first token of a prompt that long at batch 1,
``generate(max_new_tokens=1)``, bf16 and quantpack's default path.

Every row carries the memory-bandwidth limit it is measured against: ``bytes_per_token``, the bytes a decode step
reads divided by the batch (every weight: packed linears with their scales and zeros, the bf16 lm_head, norms, plus
one embedding row per sequence and the valid part of the KV cache, at the mean length of the timed steps; of a
mixture-of-experts block only the experts that ``batch`` tokens hit on average with even top-k routing);
``copy_tb_s``, a device-to-device copy's bandwidth measured in the same run (bytes read + written); ``limit_tok_s``
= copy_tb_s / bytes_per_token, and ``limit_fraction`` = tok_s / limit_tok_s.

    python benchmarks/bench_decode.py --modes default graph --batch-sizes 1 16 --context 0 4096 32768

Each measured cell is appended to benchmarks/results/decode.jsonl (device, commit, date, batch, context, model,
path, tok_s, first_call_s, the limit above), bf16 and quantpack from the same run; time-to-first-token lines have
path ``ttft`` and ``ttft_ms``; ``--profile`` adds decode_profile.jsonl. ``--device cpu`` runs the default and eager
paths on the CPU (a smoke test of the script at a tiny shape; no bandwidth meaning).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --model presets: mixture-of-experts shapes (the Llama-8B shape is the flags' defaults)
MODELS = {
    "qwen3-moe": dict(arch="qwen3_moe", layers=48, hidden=2048, intermediate=768, vocab=151936, experts=128, top_k=8,
                      heads=32, kv_heads=4, head_dim=128),  # Qwen3-30B-A3B
    "mixtral": dict(arch="mixtral", layers=32, hidden=4096, intermediate=14336, vocab=32000, experts=8, top_k=2,
                    heads=32, kv_heads=8, head_dim=128),  # Mixtral-8x7B
}


def build_moe_model(preset: dict, layers: int, device):
    """A mixture-of-experts model of ``preset``'s shape (``layers`` decoder layers), random weights, bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    p = preset
    kw = dict(hidden_size=p["hidden"], num_hidden_layers=layers, num_attention_heads=p["heads"],
              num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], vocab_size=p["vocab"],
              max_position_embeddings=8192, tie_word_embeddings=False, num_experts_per_tok=p["top_k"])
    if p["arch"] == "qwen3_moe":
        kw.update(intermediate_size=6144, moe_intermediate_size=p["intermediate"], num_experts=p["experts"],
                  norm_topk_prob=True)
    else:
        kw.update(intermediate_size=p["intermediate"], num_local_experts=p["experts"])
    config = AutoConfig.for_model(p["arch"], **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    if getattr(args, "model", None) in MODELS:
        return build_moe_model(MODELS[args.model], args.layers, device)
    heads = args.hidden // 128
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=min(8, heads), vocab_size=args.vocab,
                         max_position_embeddings=max(8192, max_context(args)), rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


@torch.no_grad()
def quantize_in_place(model, *, bits: int, group_size: int, method: str) -> int:
    """Replace every decoder linear layer by a QuantLinear made from its weight, and every experts block by a
    QuantExperts (each expert's matrices quantized as convert does, on the block's device); returns how many."""
    from quantpack.convert.plan import ROUTER_NAME
    from quantpack.modules.experts import QuantExperts, fused_experts_dims, skip_experts_switch
    from quantpack.modules.linear import QuantLinear

    blocks = [n for n, m in model.named_modules() if fused_experts_dims(m) is not None]
    for name in blocks:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, QuantExperts.from_experts(getattr(parent, child), bits=bits, group_size=group_size,
                                                         method=method, dtype=torch.bfloat16))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
             and not (blocks and ROUTER_NAME.search(n))]  # (routers stay, as convert keeps them)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, QuantLinear.from_linear(getattr(parent, child), bits=bits, group_size=group_size,
                                                       method=method, dtype=torch.bfloat16))
    skip_experts_switch(model)  # (as quantpack.load does)
    torch.cuda.empty_cache()
    return len(names) + len(blocks)


def max_context(args) -> int:
    """The longest sequence a cell reaches: its prompt and the new tokens (and slack for warm-up calls)."""
    return max([args.prompt_len, args.ttft_prompt, *args.context]) + args.new_tokens + 64


def cells(args) -> list[tuple[int, int]]:
    """The (batch, context) cells measured: every pair within ``--max-kv-tokens`` (short prompts always)."""
    return [(b, c) for c in args.context for b in args.batch_sizes if c == 0 or b * c <= args.max_kv_tokens]


def copy_bandwidth(device) -> float:
    """TB/s of a device-to-device copy of 1 GiB (bytes read + written), the median of do_bench's runs (on a CPU:
    64 MiB, best of 5, for the smoke test)."""
    if device.type == "cuda":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from timing import median_ms  # (benchmarks/timing.py)

        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = median_ms(lambda: dst.copy_(src))
        return 2 * src.numel() / (ms * 1e-3) / 1e12
    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best / 1e12


def bytes_per_token(model, batch: int, kv_positions: float) -> float:
    """Bytes a decode step of ``batch`` sequences reads, per token: every weight but the embedding table (one row of
    it per sequence instead), and the keys and values of ``kv_positions`` cached positions per sequence."""
    config = model.config
    embed = model.get_input_embeddings().weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * embed.element_size() * kv_positions
    step = weight_bytes(model) - embed.numel() * embed.element_size() + batch * (embed[0].numel() * embed.element_size()
                                                                                 + kv)
    return (step - unread_expert_bytes(model, batch)) / batch


def unread_expert_bytes(model, batch: int) -> float:
    """The bytes of experts a decode step of ``batch`` tokens does not read, on average: each layer's experts are
    tensors of the experts block with one row per expert (bf16 3-D parameters, or QuantExperts' stacked buffers, the
    codes 5-D in the mma layout);
    with top-k routing spread evenly, ``E (1 - (1 - k/E)^batch)`` of the ``E`` are hit (random weights route about
    evenly)."""
    config = model.config.get_text_config()
    experts = next((getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(config, k, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return 0.0
    total = 0
    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if t.dim() >= 3 and t.shape[0] == experts:
                total += t.numel() * t.element_size()
    hit = experts * (1 - (1 - top_k / experts) ** batch)
    return total * (1 - hit / experts)


def weight_bytes(model) -> int:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


@torch.no_grad()
def generate_decode(model, prompt, new_tokens: int, repeats: int = 3, **generate_kw) -> float:
    """tokens/s of generate()'s decode steps (eager, or compiled by transformers with a static cache):
    (time for N new tokens - time for 1) / (N - 1), each time the best of ``repeats`` (eager decode is bound by the
    host, whose speed varies from moment to moment)."""
    kw = dict(do_sample=False, pad_token_id=0, **generate_kw)

    def timed(n):
        _sync()
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync()
        return time.perf_counter() - t

    timed(4)  # warm-up: kernels compiled, caches allocated
    t1 = min(timed(1) for _ in range(repeats))
    tn = min(timed(new_tokens) for _ in range(repeats))
    if tn <= t1:  # (a noisy host can make N - 1 short steps vanish in the prefill's spread)
        raise RuntimeError(f"{new_tokens - 1} decode steps took no measurable time beyond the prefill's "
                           f"({tn:.4f} s against {t1:.4f} s); time more steps (--new-tokens)")
    return prompt.shape[0] * (new_tokens - 1) / (tn - t1)


@torch.no_grad()
def eager_steps(model, prompt, new_tokens: int) -> tuple[list[float], list[float]]:
    """The wall time and the main thread's CPU time of each decode step of one eager ``generate`` (ms; the prefill
    excluded), stamped by a stopping criterion, which transformers calls once a step. Steps, not whole calls: the
    host's Python speed drifts for seconds at a time, and a median over many steps of alternating calls sees through
    that; the CPU time leaves out the time the thread was not running (a shared host's other work)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append((time.perf_counter(), time.thread_time()))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              stopping_criteria=StoppingCriteriaList([Stamp()]))
    with torch.no_grad():
        model.generate(prompt, **kw)
    return ([(b[0] - a[0]) * 1e3 for a, b in zip(stamps, stamps[1:])],
            [(b[1] - a[1]) * 1e3 for a, b in zip(stamps, stamps[1:])])


def eager_alternating(bf16, qmodel, prompt, new_tokens: int, rounds: int) -> dict:
    """bf16 and quantized eager ``generate`` timed alternately, one call each a round (after one round of warm-up):
    each model's tokens/s from its median step time over all rounds, and the median and range of the rounds' ratios
    (quantized over bf16, by each round's median step)."""
    from quantpack.modules import fused

    steps = {"bf16": [], "quantpack": []}
    ratios = []
    for r in range(rounds + 1):
        fused.remove(qmodel)  # (the fused rotary replaces transformers' function, which bf16 calls too)
        b = eager_steps(bf16, prompt, new_tokens)[0]
        fused.apply(qmodel)
        q = eager_steps(qmodel, prompt, new_tokens)[0]
        if r:
            steps["bf16"] += b
            steps["quantpack"] += q
            ratios.append(statistics.median(b) / statistics.median(q))
    ratios.sort()
    tok_s = {k: prompt.shape[0] * 1e3 / statistics.median(v) for k, v in steps.items()}
    return {"bf16_tok_s": tok_s["bf16"], "tok_s": tok_s["quantpack"], "ratio": statistics.median(ratios),
            "ratio_range": [ratios[0], ratios[-1]], "rounds": rounds}


def compiled_decode(model, prompt, new_tokens: int) -> tuple[float, float]:
    """(tokens/s, seconds of the first call) of generate() with a static cache, whose decode step transformers
    compiles (inductor, CUDA graphs) on the first call."""
    _sync()
    t = time.perf_counter()
    model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
    _sync()
    first = time.perf_counter() - t
    return generate_decode(model, prompt, new_tokens, cache_implementation="static"), first


def without_launch_plans(fn, *args):
    """``fn(*args)`` with QuantLinear's launch plans turned off (every call does its host-side dispatch again)."""
    saved = os.environ.get("QUANTPACK_LAUNCH_PLANS")
    os.environ["QUANTPACK_LAUNCH_PLANS"] = "0"
    try:
        return fn(*args)
    finally:
        if saved is None:
            del os.environ["QUANTPACK_LAUNCH_PLANS"]
        else:
            os.environ["QUANTPACK_LAUNCH_PLANS"] = saved


@torch.no_grad()
def graph_decode(model, prompt, new_tokens: int) -> float:
    """tokens/s of greedy decode steps replayed from a CUDA graph (static KV cache)."""
    from transformers import StaticCache

    b, p = prompt.shape
    device = prompt.device
    cache = StaticCache(config=model.config, max_cache_len=p + new_tokens + 8)
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                cache_position=torch.arange(p, device=device), logits_to_keep=1)  # (a long prompt's logits: GBs)
    ids = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([p], device=device)

    def step():
        return model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos,
                     position_ids=pos.expand(b, 1)).logits

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()

    def run(n):
        for _ in range(n):
            graph.replay()
            ids.copy_(logits[:, -1:].argmax(-1))
            pos.add_(1)

    run(2)
    pos.fill_(p)
    _sync()
    t = time.perf_counter()
    run(new_tokens)
    _sync()
    return b * new_tokens / (time.perf_counter() - t)


@torch.no_grad()
def kernel_vs_reference(model, prompt) -> float:
    """Max relative difference of the logits: fused kernel vs the reference path, same packed weights."""
    from quantpack.modules.linear import QuantLinear

    fused = model(prompt).logits.float()
    QuantLinear.backend = "reference"
    try:
        ref = model(prompt).logits.float()
    finally:
        QuantLinear.backend = "auto"
    return ((fused - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def default_decode(model, prompt, new_tokens: int) -> tuple[float, float]:
    """(tokens/s, seconds of the first call) of plain ``generate`` on the model as quantpack.load leaves it."""
    from quantpack import generation

    generation.enable(model, "graphs")
    try:
        _sync()
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        _sync()
        first = time.perf_counter() - t
        return generate_decode(model, prompt, new_tokens), first
    finally:
        generation.disable(model)


# Kernel name -> op family, first match wins (Triton kernels by their function names, PyTorch's by functor).
FAMILIES = [
    ("quantized linears", r"forward_kernel|transposed_kernel|_gemv_kernel|_mma_gemv_kernel|_wgmma_kernel|_w8a8"
                          r"|_w4a8_kernel|_quantize_fp8_kernel|_quantize_rows_kernel|_dequant(ize)?_kernel"
                          r"|_experts_kernel"),
    ("experts' routing, activation and slot sums (quantpack)",
     r"_rank_kernel|_blocks_kernel|_place_kernel|_gather_kernel|_activate_kernel|_weighted_sum_kernel"
     r"|_sum_slots_kernel|_unpack_kernel"),
    ("attention", r"flash|fmha|attention|softmax|bmm|efficient"),
    ("cuBLAS GEMM/GEMV (bf16 linears, lm_head)", r"gemm|gemv|nvjet|cutlass|xmma|sm90_|splitKreduce"),
    ("fused RMSNorm, rotary, SiLU*up (quantpack)", r"_rms_norm_kernel|_rotary_kernel|_silu_mul_kernel"),
    ("KV-cache update", r"_kv_write_kernel|index_copy|index_put|scatter"),
    ("norms (pow, mean, rsqrt)", r"pow|rsqrt|MeanOps|mean|norm"),
    ("rotary (cos, sin, neg, cat)", r"cos|sin|neg|CatArray|cat_"),
    ("activation (silu)", r"silu|sigmoid|gelu"),
    ("elementwise mul/add", r"Mul|mul|Add|add"),
    ("copies and casts", r"copy|Copy|cast|fill"),
    ("sampling (argmax)", r"ArgMax|argmax|max"),
    ("embedding", r"index_select|indexSelect|embedding|gather"),
]


@torch.no_grad()
def profile_decode(model, prompt, steps: int = 16) -> dict:
    """GPU time of ``steps`` decode steps on the default path, per op family: the profiler's kernel records of a
    ``generate`` of ``steps + 1`` tokens less those of a 1-token one (the prefill), per step (:func:`step_profile`).
    'gaps' is the step's wall time no kernel ran (launch gaps between graph nodes, host work between steps)."""
    from quantpack import generation

    generation.enable(model, "graphs")
    try:
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        runs = {}
        for n in (1, steps + 1):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                _sync()
                t = time.perf_counter()
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                _sync()
                wall = time.perf_counter() - t
            kernels = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
                    kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total
            runs[n] = (kernels, wall)
    finally:
        generation.disable(model)
    return step_profile(*runs[steps + 1], *runs[1], steps)


def step_profile(kernels: dict, wall: float, prefill_kernels: dict, prefill_wall: float, steps: int) -> dict:
    """Per decode step, from a profiled ``generate`` of ``steps`` decode steps and one of the prefill alone (kernel
    name -> total us, and wall seconds, each): each kernel's time less the prefill's, by op family (FAMILIES), the
    step's wall time, its gaps, and the twelve largest kernels."""
    import re

    per_kernel = {name: max(us - prefill_kernels.get(name, 0.0), 0.0) / steps for name, us in kernels.items()}
    per_step_us = {}
    for name, us in per_kernel.items():
        family = next((f for f, rx in FAMILIES if re.search(rx, name)), "other")
        per_step_us[family] = per_step_us.get(family, 0.0) + us
    busy = sum(per_step_us.values())
    step_us = max(wall - prefill_wall, 0.0) * 1e6 / steps
    per_step_us["gaps (no kernel running)"] = max(step_us - busy, 0.0)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {"step_us": step_us, "families_us": per_step_us, "top_kernels_us": {k[:120]: v for k, v in top}}


def append_results(args, results) -> None:
    """One JSON line per measured cell into benchmarks/results/decode.jsonl."""
    import datetime
    import subprocess

    root = os.path.dirname(os.path.abspath(__file__))
    commit = args.commit  # (a copy of the tree may carry another commit's .git)
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    base = {"device": results["device"], "commit": commit, "date": datetime.date.today().isoformat(),
            "shape": results["shape"], "quant": results["quant"], "new_tokens": args.new_tokens,
            "torch": results["torch"], "transformers": results["transformers"]}
    path = args.results or os.path.join(root, "results", "decode.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        for row in results["rows"]:
            model = "bf16" if row["model"] == "bf16" else "quantpack"
            variant = "merged" if row["model"].endswith("merged") else "layers"
            if " lm_head w" in row["model"]:
                variant = f"merged, lm_head {row['model'].rsplit(' ', 1)[1]}"
            for key, value in row.items():
                if key.endswith("_tok_s") and key != "limit_tok_s":
                    path_name = key.removesuffix("_tok_s")
                    line = {**base, "batch": row["batch"], "context": row["context"], "model": model,
                            "path": path_name, "tok_s": value, "first_call_s": row.get(f"{path_name}_first_call_s"),
                            "bytes_per_token": row["bytes_per_token"], "copy_tb_s": results["copy_tb_s"],
                            "limit_tok_s": row["limit_tok_s"], "limit_fraction": value / row["limit_tok_s"]}
                    if model == "quantpack":
                        line["projections"] = variant
                    detail = row.get(f"{path_name}_detail")
                    if detail:  # (alternating rounds: the ratio to bf16 in those rounds)
                        line.update(ratio=detail["ratio"], ratio_range=detail["ratio_range"], rounds=detail["rounds"],
                                    bf16_tok_s=detail["bf16_tok_s"])
                    f.write(json.dumps(line) + "\n")
        for line in results.get("ttft", []):
            f.write(json.dumps({**base, **line}) + "\n")
        for prof in results.get("profiles", []):
            f2 = path.replace("decode.jsonl", "decode_profile.jsonl")
            with open(f2, "a") as g:
                g.write(json.dumps({**base, **prof}) + "\n")


def measure(model, args, prompts, label, results, quantized=False, bf16=None):
    """Time ``model`` in each of ``args.modes`` at each batch size into a row of ``results``; ``bf16``: the bf16
    model the quantized one's eager rounds alternate with."""
    for b, context in cells(args):
        prompt = prompts[b, context]
        row = {"model": label, "batch": b, "context": context}
        if "default" in args.modes and quantized:
            try:
                row["default_tok_s"], row["default_first_call_s"] = default_decode(model, prompt, args.new_tokens)
            except Exception as exc:
                row["default_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if args.profile:
            try:
                prof = profile_decode(model, prompt)
                prof.update({"batch": b, "model": label})
                results.setdefault("profiles", []).append(prof)
                print(json.dumps(prof), flush=True)
            except Exception as exc:
                print(f"profile failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if "eager" in args.modes and quantized:  # (bf16's eager cell: from these rounds)
            try:
                got = eager_alternating(bf16, model, prompt, args.new_tokens, args.eager_rounds)
                row["eager_tok_s"], row["eager_ratio"] = got["tok_s"], got["ratio"]
                row["eager_detail"] = got
                bf16_row = next(r for r in results["rows"] if r["model"] == "bf16" and r["batch"] == b
                                and r["context"] == context)
                bf16_row.setdefault("eager_tok_s", got["bf16_tok_s"])  # (the first quantized model's rounds)
                if args.no_plans:
                    row["eager_no_plans_tok_s"] = without_launch_plans(generate_decode, model, prompt,
                                                                       args.new_tokens)
            except Exception as exc:  # keep going: report what failed
                row["eager_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if "graph" in args.modes and prompt.is_cuda:
            try:
                row["graph_tok_s"] = graph_decode(model, prompt, args.new_tokens)
            except Exception as exc:
                row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if "compiled" in args.modes and prompt.is_cuda:
            try:
                row["compiled_tok_s"], row["compiled_first_call_s"] = compiled_decode(model, prompt,
                                                                                      args.new_tokens)
            except Exception as exc:
                row["compiled_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        # the bandwidth limit: the timed steps' mean cache length
        row["bytes_per_token"] = bytes_per_token(model, b, prompt.shape[1] + args.new_tokens / 2)
        row["limit_tok_s"] = results["copy_tb_s"] * 1e12 / row["bytes_per_token"]
        results["rows"].append(row)
        print(json.dumps(row), flush=True)


@torch.no_grad()
def time_to_first_token(model, prompt, quantized: bool, repeats: int = 5) -> float:
    """Milliseconds of ``generate(prompt, max_new_tokens=1)`` (prefill and the first token), the median of
    ``repeats`` after a warm-up; a quantized model on its default path (quantpack.load's), bf16 as transformers
    gives it."""
    from quantpack import generation

    if quantized:
        generation.enable(model, "graphs")
    try:
        times = []
        for _ in range(repeats + 1):
            _sync()
            t = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            _sync()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times[1:])
    finally:
        if quantized:
            generation.disable(model)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama-8b", *MODELS], default="llama-8b",
                        help="the shape: Llama-3.1-8B (the flags below), or a mixture of experts: qwen3-moe "
                             "(Qwen3-30B-A3B), mixtral (Mixtral-8x7B); --layers still sets the depth")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers [default: the model's]")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, nargs="+", default=[0],
                        help="prompt lengths prefilled before the timed decode steps; 0: --prompt-len [default: 0]")
    parser.add_argument("--max-kv-tokens", type=int, default=65536,
                        help="skip (batch, context) cells whose batch x context exceeds this [default: 65536]")
    parser.add_argument("--ttft-prompt", type=int, default=2048,
                        help="time the first token of a prompt this long at batch 1, bf16 and quantpack; 0 skips "
                             "[default: 2048]")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke test at a tiny shape (default and eager paths only)")
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--method", default="rtn", choices=["rtn", "hqq"])
    parser.add_argument("--modes", nargs="+", default=["default", "eager", "graph", "compiled"],
                        choices=["default", "eager", "graph", "compiled"])
    parser.add_argument("--profile", action="store_true", help="profile the default path's decode steps by op family")
    parser.add_argument("--no-plans", action="store_true", help="also time eager decode without launch plans")
    parser.add_argument("--eager-rounds", type=int, default=5,
                        help="alternating rounds of bf16 and quantized eager decode, and of their first tokens where "
                             "--modes eager holds both models [default: 5]")
    parser.add_argument("--commit", help="the commit measured, where the tree has no .git")
    parser.add_argument("--results", help="JSON-lines file to append to [default: benchmarks/results/decode.jsonl]")
    parser.add_argument("--no-merged", dest="merged", action="store_false",
                        help="skip the quantized model with merged projections (q/k/v, gate/up)")
    parser.add_argument("--lm-head-bits", type=int, nargs="*", default=[], choices=[4, 8],
                        help="also measure the merged model with lm_head quantized to these bits, group size as the "
                             "rest (convert --quantize-lm-head [--bits-for lm_head=8])")
    parser.add_argument("--unmerged", action="store_true",
                        help="also measure each quantized layer alone (quantpack.load(..., merge=False))")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    preset = MODELS.get(args.model)
    if preset is not None:
        args.hidden, args.intermediate, args.vocab = preset["hidden"], preset["intermediate"], preset["vocab"]
    if args.layers is None:
        args.layers = preset["layers"] if preset is not None else 32
    if args.device == "cuda" and not torch.cuda.is_available():
        print("Error: this benchmark needs a CUDA GPU (--device cpu runs a smoke test)", file=sys.stderr)
        return 2
    if min(args.context) < 0 or args.ttft_prompt < 0 or args.new_tokens < 2:
        print("Error: --context and --ttft-prompt take lengths >= 0, --new-tokens at least 2", file=sys.stderr)
        return 2
    import transformers

    import quantpack

    device = torch.device(args.device)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "transformers": transformers.__version__, "quantpack": quantpack.__version__,
               "shape": {**{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "vocab")},
                         **({"model": args.model, "experts": preset["experts"], "top_k": preset["top_k"]}
                            if preset is not None else {})},
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "quant": {"bits": args.bits, "group_size": args.group_size, "method": args.method}, "rows": []}
    t = time.perf_counter()
    model = build_model(args, device)
    results["build_s"] = time.perf_counter() - t
    g = torch.Generator(device="cpu").manual_seed(1)
    prompts = {(b, c): torch.randint(0, args.vocab, (b, c or args.prompt_len), generator=g).to(device)
               for b, c in cells(args)}
    ttft_prompt = torch.randint(0, args.vocab, (1, args.ttft_prompt), generator=g).to(device) if args.ttft_prompt \
        else None
    results["copy_tb_s"] = copy_bandwidth(device)
    results["bf16_weight_bytes"] = weight_bytes(model)
    measure(model, args, prompts, "bf16", results)
    if ttft_prompt is not None:
        results["ttft"] = [{"batch": 1, "context": args.ttft_prompt, "model": "bf16", "path": "ttft",
                            "ttft_ms": time_to_first_token(model, ttft_prompt, quantized=False)}]
    t = time.perf_counter()
    results["quantized_layers"] = quantize_in_place(model, bits=args.bits, group_size=args.group_size,
                                                    method=args.method)
    results["quantize_s"] = time.perf_counter() - t
    bf16 = None
    if "eager" in args.modes:
        # the quantized models' eager rounds (and the first token's) alternate with a bf16 model: the same one built
        # again from the same seed next to the quantized copy, where a copy taken before quantizing would need two bf16
        # models at once (Mixtral's 94 GB does not fit twice)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        bf16 = build_model(args, device)
    results["quant_weight_bytes"] = weight_bytes(model)
    from quantpack.modules import fused

    results["fused_norms"] = fused.apply(model)  # (as quantpack.load does: RMSNorm, rotary as one kernel each)
    from quantpack.modules.experts import use_mma_layouts

    results["mma_experts_blocks"] = use_mma_layouts(model)  # (as quantpack.load does on a GPU)
    short = prompts[min(cells(args))]
    results["kernel_vs_reference_rel_err"] = kernel_vs_reference(model, short[:, :16])
    print(json.dumps({k: v for k, v in results.items() if k != "rows"}), flush=True)
    if args.unmerged:
        measure(model, args, prompts, f"quantpack w{args.bits} g{args.group_size}", results, quantized=True,
                bf16=bf16)
    if args.merged:  # each layer's q/k/v and gate/up as one GEMV at decode, as quantpack.load links them
        from quantpack.modules.merged import merge_projections

        results["merged_groups"] = merge_projections(model)
        one_token = short[:1, :1]  # (one row of x: the merged decode path)
        results["merged_kernel_vs_reference_rel_err"] = kernel_vs_reference(model, one_token)
        print(json.dumps({k: v for k, v in results.items() if k.startswith("merged")}), flush=True)
        measure(model, args, prompts, f"quantpack w{args.bits} g{args.group_size} merged", results, quantized=True,
                bf16=bf16)
    if ttft_prompt is not None and bf16 is not None:
        # both models at hand: rounds alternate between them, so that a drift of the host or the GPU over the run
        # moves both (bf16's first token of a mixture of experts moved by 1.7x between processes)
        rounds = [(time_to_first_token(bf16, ttft_prompt, quantized=False),
                   time_to_first_token(model, ttft_prompt, quantized=True)) for _ in range(args.eager_rounds)]
        b_ms, q_ms = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        results["ttft"][0].update(ttft_ms=b_ms, alternating_rounds=len(rounds))
        results["ttft"].append({"batch": 1, "context": args.ttft_prompt, "model": "quantpack", "path": "ttft",
                                "ttft_ms": q_ms, "ratio_to_bf16": b_ms / q_ms, "alternating_rounds": len(rounds),
                                "ratio_range": [min(b / q for b, q in rounds), max(b / q for b, q in rounds)]})
    elif ttft_prompt is not None:
        ms = time_to_first_token(model, ttft_prompt, quantized=True)
        results["ttft"].append({"batch": 1, "context": args.ttft_prompt, "model": "quantpack", "path": "ttft",
                                "ttft_ms": ms, "ratio_to_bf16": results["ttft"][0]["ttft_ms"] / ms})
    bf16_head = model.lm_head
    for bits in args.lm_head_bits:  # (last: the rows above keep the bf16 lm_head, as convert does by default)
        from quantpack.modules.linear import QuantLinear

        with torch.no_grad():
            model.lm_head = QuantLinear.from_linear(bf16_head, bits=bits, group_size=args.group_size,
                                                    method=args.method, dtype=torch.bfloat16)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results[f"lm_head_w{bits}_weight_bytes"] = weight_bytes(model)
        measure(model, args, prompts, f"quantpack w{args.bits} g{args.group_size} merged lm_head w{bits}", results,
                quantized=True, bf16=bf16)

    nan = float("nan")
    print(f"\n{'model':<30}{'batch':>6}{'context':>8}{'limit tok/s':>12}{'default tok/s':>15}{'(first s)':>10}{'eager tok/s':>14}{'(x bf16)':>9}"
          f"{'graph tok/s':>14}{'compiled tok/s':>16}{'(first call s)':>16}{'eager, no launch plans':>24}")
    for row in results["rows"]:
        print(f"{row['model']:<30}{row['batch']:>6}{row['context']:>8}{row['limit_tok_s']:>12.0f}"
              f"{row.get('default_tok_s', nan):>15.1f}"
              f"{row.get('default_first_call_s', nan):>10.1f}{row.get('eager_tok_s', nan):>14.1f}"
              f"{row.get('eager_ratio', nan):>9.2f}"
              f"{row.get('graph_tok_s', nan):>14.1f}{row.get('compiled_tok_s', nan):>16.1f}"
              f"{row.get('compiled_first_call_s', nan):>16.1f}"
              f"{row.get('eager_no_plans_tok_s', nan):>24.1f}")
    print(f"copy bandwidth {results['copy_tb_s']:.2f} TB/s (limit tok/s = that / bytes_per_token)")
    for line in results.get("ttft", []):
        print(f"time to first token, {line['context']}-token prompt, {line['model']}: {line['ttft_ms']:.1f} ms"
              + (f" ({line['ratio_to_bf16']:.2f}x bf16's speed)" if "ratio_to_bf16" in line else ""))
    for prof in results.get("profiles", []):
        print(f"\n{prof['model']}, batch {prof['batch']}: one decode step {prof['step_us']:.0f} us")
        for family, us in sorted(prof["families_us"].items(), key=lambda kv: -kv[1]):
            print(f"  {family:<45}{us:>9.0f} us {100 * us / prof['step_us']:>5.1f}%")
    append_results(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
