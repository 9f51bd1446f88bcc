"""Where the host time of generate()'s decode steps goes: cProfile of one default-path generate call on the 8B
shape (after warm-up), top functions by own time. An experiment, not a product benchmark."""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import bench_decode  # noqa: E402


def main():
    parser = bench_decode.argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--decode", default="graphs", choices=["graphs", "eager"])
    a = parser.parse_args()
    args = bench_decode.argparse.Namespace(hidden=4096, intermediate=14336, vocab=128256, layers=a.layers)
    model = bench_decode.build_model(args, torch.device("cuda"))
    if not a.bf16:
        bench_decode.quantize_in_place(model, bits=4, group_size=128, method="rtn")
        from quantpack.modules import fused
        from quantpack.modules.merged import merge_projections
        fused.apply(model)
        merge_projections(model)
    from quantpack import generation
    import transformers
    generation.enable(model, a.decode)
    prompt = torch.randint(0, 128256, (a.batch, 32), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens)
    with torch.no_grad():
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        prof = cProfile.Profile()
        prof.enable()
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
        prof.disable()
    print(f"transformers {transformers.__version__}: {a.batch * a.new_tokens / wall:.1f} tok/s "
          f"({wall * 1e3 / a.new_tokens:.2f} ms a token incl. prefill)")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
    print(s.getvalue()[-9000:])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    print(s.getvalue()[-9000:])


if __name__ == "__main__":
    main()
