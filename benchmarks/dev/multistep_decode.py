"""How fast greedy decode runs with several steps in one CUDA graph: the lever left after the step's own kernels,
measured apart from the product. The default path replays one captured step per token from transformers'
``generate()``, which runs about 90 small kernels of its own a step (mask, logits processors, argmax, stop check,
input copies) and the host's bookkeeping between replays. Here ``S`` steps are captured back to back, each taking
its input token from the argmax of the step before and advancing the positions on the device; the host replays the
graph once per ``S`` tokens. The tokens must equal the default path's (greedy, same model); the script says so and
prints tok/s for both. An experiment, not a product benchmark.

    python benchmarks/dev/multistep_decode.py --steps 1 4 16          # 8B shape on a GPU
    python benchmarks/dev/multistep_decode.py --device cpu --layers 2 --hidden 256 --intermediate 512 --vocab 1000
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import bench_decode  # noqa: E402


def build(a, device):
    args = argparse.Namespace(hidden=a.hidden, intermediate=a.intermediate, vocab=a.vocab, layers=a.layers,
                              prompt_len=a.prompt_len, ttft_prompt=0, context=[0], new_tokens=a.new_tokens)
    model = bench_decode.build_model(args, device)
    model.generation_config.eos_token_id = None  # (random weights: decode exactly --new-tokens tokens)
    bench_decode.quantize_in_place(model, bits=4, group_size=128, method="rtn")
    from quantpack.modules import fused
    from quantpack.modules.merged import merge_projections

    fused.apply(model)
    merge_projections(model)
    return model


class MultiStep:
    """Greedy decode of ``steps`` tokens per call (one graph replay on a GPU) over a static cache of ``length``."""

    def __init__(self, model, batch: int, length: int, steps: int):
        from transformers import StaticCache

        from quantpack import generation

        self.model, self.steps, self.length = model, steps, length
        device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
        self.cache_kwarg = generation._cache_kwarg(model)
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.out = torch.zeros((batch, steps), dtype=torch.long, device=device)
        self.kv_positions = torch.arange(length, device=device)
        self.graph = None

    def prefill(self, prompt):
        self.cache.reset()
        n = prompt.shape[1]
        kwargs = {self.cache_kwarg: self.cache, "use_cache": True, "logits_to_keep": 1}
        if self.takes_cache_position:
            kwargs["cache_position"] = torch.arange(n, device=prompt.device)
        logits = self.model(input_ids=prompt, **kwargs).logits[:, -1]
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.pos.fill_(n)
        return self.ids[:, 0].clone()

    def _step(self, i: int):
        batch = self.ids.shape[0]
        mask = (self.kv_positions[None, :] <= self.pos[:, :1]).view(batch, 1, 1, self.length)
        kwargs = {self.cache_kwarg: self.cache, "use_cache": True, "logits_to_keep": 1, "attention_mask": mask}
        if self.takes_cache_position:
            kwargs["cache_position"] = self.pos[0]
        logits = self.model(input_ids=self.ids, position_ids=self.pos, **kwargs).logits[:, -1]
        nxt = logits.argmax(-1)
        self.out[:, i] = nxt
        self.ids.copy_(nxt[:, None])
        self.pos.add_(1)

    def _run(self):
        from quantpack.modules import attention

        with attention.decoding(self.cache):
            for i in range(self.steps):
                self._step(i)

    def decode(self):
        """The next ``steps`` tokens (batch, steps), on the device."""
        if self.ids.device.type != "cuda":
            self._run()
            return self.out
        if self.graph is None:
            saved = [(t, t.clone()) for t in (self.ids, self.pos, *self._cache_tensors())]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run()  # (warm-up: compiles and first-use work outside the capture)
            torch.cuda.current_stream().wait_stream(stream)
            for t, copy in saved:
                t.copy_(copy)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._run()
            for t, copy in saved:
                t.copy_(copy)
        self.graph.replay()
        return self.out

    def _cache_tensors(self):
        from quantpack.generation import _tensor_objects

        return _tensor_objects(self.cache)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 4, 16])
    a = p.parse_args()
    device = torch.device(a.device)
    model = build(a, device)
    from quantpack import generation

    if device.type == "cuda":
        generation.enable(model, "graphs")
    else:
        from quantpack.modules import attention

        attention.use(model)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        for batch in a.batch:
            prompt = torch.randint(0, a.vocab, (batch, a.prompt_len), device=device)
            kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=a.new_tokens)
            ref = model.generate(prompt, **kw)[:, a.prompt_len:]
            sync()
            t = time.perf_counter()
            model.generate(prompt, **kw)
            sync()
            t_one = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(prompt, **dict(kw, max_new_tokens=1))
            sync()
            t_prefill = time.perf_counter() - t
            base = batch * (a.new_tokens - 1) / max(t_one - t_prefill, 1e-9)
            print(f"batch {batch}: generate() {base:.1f} tok/s (decode steps only)", flush=True)
            for steps in a.steps:
                length = -(-(a.prompt_len + a.new_tokens + steps) // 256) * 256
                ms = MultiStep(model, batch, length, steps)
                rounds = -(-(a.new_tokens - 1) // steps)
                first = ms.prefill(prompt)
                toks = [first[:, None]] + [ms.decode().clone() for _ in range(rounds)]  # (capture, check)
                got = torch.cat(toks, 1)[:, :a.new_tokens]
                same = torch.equal(got, ref)
                ms.prefill(prompt)
                sync()
                t = time.perf_counter()
                for _ in range(rounds):
                    ms.decode()
                sync()
                rate = batch * rounds * steps / (time.perf_counter() - t)
                print(f"batch {batch}, {steps} steps a graph: {rate:.1f} tok/s ({rate / base:.2f}x generate()), "
                      f"tokens {'equal' if same else 'DIFFER from'} generate()'s"
                      + ("" if same else f" (first difference at token "
                         f"{int((got != ref).any(0).nonzero()[0])})"), flush=True)
                del ms
                if device.type == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
