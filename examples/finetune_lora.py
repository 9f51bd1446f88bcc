"""Train LoRA adapters (peft) on a frozen quantpack-quantized model and watch the loss fall.

    python examples/finetune_lora.py                       # builds and converts a tiny Llama first (CPU, seconds)
    python examples/finetune_lora.py Llama-3.1-8B-qp4g128 --text my_corpus.txt --steps 200 --output adapters/

The packed weights stay frozen (they are buffers of QuantLinear); gradients flow through
QuantLinear's backward (on a GPU: the transposed fused kernel) to the adapters and the inputs.
Only the adapters are trained and saved.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def tiny_packed_checkpoint(workdir: Path) -> Path:
    """A tiny real Llama, converted to 4-bit by quantpack: lets the example run anywhere."""
    from quantpack.convert import convert
    from quantpack.tiny import make_tiny_llama

    source = make_tiny_llama(workdir / "tiny-llama", dtype=torch.bfloat16)
    convert(source, workdir / "tiny-llama-qp4g64", group_size=64, progress=False)
    return workdir / "tiny-llama-qp4g64"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="packed checkpoint directory or hub repo id "
                        "(default: a tiny Llama converted on the spot)")
    parser.add_argument("--text", type=Path, help="training text, one example per line (default: a built-in passage)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--target-modules", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                        help="comma-separated names of the linear layers that get adapters")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: a GPU if there is one)")
    parser.add_argument("--output", type=Path, help="directory to save the trained adapters to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.text is not None and not args.text.is_file():
        parser.error(f"--text: no such file {args.text}")

    with tempfile.TemporaryDirectory() as tmp:
        return train(args, tmp)


def train(args, tmp: str) -> int:
    from peft import get_peft_model
    from transformers import AutoTokenizer

    import quantpack.loader
    from quantpack.integrations.peft import lora_config
    from quantpack.tiny import PASSAGE

    torch.manual_seed(args.seed)
    path = args.checkpoint or tiny_packed_checkpoint(Path(tmp))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # Unquantized weights (embeddings, norms, lm_head) and activations: bf16 on a GPU, float32 on the CPU.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = quantpack.loader.load(path, device=device, dtype=dtype)
    except ValueError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    lines = (args.text.read_text() if args.text else PASSAGE).splitlines()
    batch = tokenizer([line for line in lines if line.strip()], return_tensors="pt", padding=True).to(model.device)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    config = lora_config(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                         target_modules=args.target_modules.split(","))
    model = get_peft_model(model, config)
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    losses = []
    for step in range(1, args.steps + 1):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    if args.output:
        model.save_pretrained(args.output)
        print(f"adapters saved to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
