"""Train a small Llama on the repository's own documentation: a causal LM whose weights have
learned structure, as a second witness for benchmarks/bench_quality.py (CPU, a few minutes).

    python benchmarks/train_witness.py OUT_DIR [--steps 400]

Text: README.md and docs/*.md, the last tenth held out (bench_quality.py evaluates on it).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from quantpack.tiny import PASSAGE, make_tiny_llama, quiet_transformers

ROOT = Path(__file__).resolve().parent.parent


def corpus() -> tuple[str, str]:
    """(train, held-out) text: the shipped documentation, split 90/10 by characters."""
    text = "\n\n".join([PASSAGE] + [p.read_text(encoding="utf-8") for p in [ROOT / "README.md",
                                                                             *sorted((ROOT / "docs").glob("*.md"))]])
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = Path(args.out)
    with quiet_transformers():
        make_tiny_llama(out, num_shards=1, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, vocab_size=512, seed=0)
        model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    train, _ = corpus()
    ids = torch.tensor(tok(train, add_special_tokens=False)["input_ids"])
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(ids) - args.seq - 1, (args.batch,))
        batch = torch.stack([ids[s:s + args.seq] for s in starts])
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()
    model.save_pretrained(out)


if __name__ == "__main__":
    main()
