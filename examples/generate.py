"""Load a quantpack checkpoint and generate text.

    python examples/generate.py Llama-3.1-8B-qp4g128 --prompt "The capital of France is"
    python examples/generate.py owner/some-model-qp4 --chat --prompt "Tell me a joke" --max-new-tokens 64
    python examples/generate.py ./tiny-qp4 --device cpu            # CPU: quantpack's reference path
    python examples/generate.py Llama-3.1-8B-qp4g128 --static-cache --max-new-tokens 256   # compiled decode

On a GPU the quantized layers run the fused Triton kernels; the rest is plain transformers, so
anything ``model.generate`` accepts works the same way.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="packed checkpoint directory or hub repo id (made by `quantpack convert`)")
    parser.add_argument("--prompt", default="Quantization stores each weight", help="text to continue")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: a GPU if there is one)")
    parser.add_argument("--device-map", default=None, help="'auto' to spread the model over several GPUs")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the unquantized weights and activations (default: as stored)")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    parser.add_argument("--static-cache", action="store_true",
                        help="static KV cache: on a GPU transformers then compiles the decode step (CUDA graphs), "
                             "about a minute the first time, about 2x the eager decode speed after")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")

    import quantpack.loader
    from transformers import AutoTokenizer

    try:
        model = quantpack.loader.load(args.checkpoint, device=args.device, device_map=args.device_map,
                                      dtype=DTYPES.get(args.dtype), revision=args.revision)
    except ValueError as exc:  # bad checkpoint or arguments: one line, no traceback
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    if args.chat:
        if not tokenizer.chat_template:
            print("Error: --chat: this tokenizer has no chat template; drop --chat", file=sys.stderr)
            return 2
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    else:
        inputs = tokenizer(args.prompt, return_tensors="pt")
    inputs = inputs.to(model.device)

    torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 else \
        dict(do_sample=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             cache_implementation="static" if args.static_cache else None, **sampling)
    seconds = time.perf_counter() - start
    new_tokens = out[0, inputs["input_ids"].shape[1]:]
    print(tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=True) +
          tokenizer.decode(new_tokens, skip_special_tokens=True))
    # (transformers compiles the decode step only on accelerators, and in this process's first static-cache call)
    compiling = "; including compiling the decode step" if args.static_cache and model.device.type == "cuda" else ""
    print(f"[{len(new_tokens)} tokens in {seconds:.2f} s, {len(new_tokens) / seconds:.1f} tokens/s on "
          f"{model.device}{compiling}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
