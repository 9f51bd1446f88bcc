"""Run in a child process by tests/integrations/test_vllm.py: serve a packed checkpoint with vLLM (CPU) and write
per-token prompt log-probs, greedy generations and which processes registered the plugin to a JSON
file (vLLM logs to stdout, so results go to a file). Argv: MODEL_DIR TP OUT_JSON PROMPTS_JSON [ep] (ep: experts
split over the TP ranks by expert parallelism instead of tensor parallelism)."""
import json
import os
import sys


def plugin_state(worker, *_args, **_kwargs):
    """Runs in each vLLM worker: was the quantpack plugin registered there, and by its entry point? How many experts
    does its first experts layer hold (None without one)?"""
    import os

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    cls = get_quantization_config("quantpack") if "quantpack" in QUANTIZATION_METHODS else None
    experts = [m.w13_qweight.shape[0] for m in worker.model_runner.get_model().modules() if hasattr(m, "w13_qweight")]
    return {"pid": os.getpid(), "config_class": None if cls is None else f"{cls.__module__}.{cls.__name__}",
            "local_experts": experts[0] if experts else None}


def main():
    model, tp, out, prompts_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    prompts = json.loads(open(prompts_file).read())
    from vllm import LLM, SamplingParams

    kwargs = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    if sys.argv[5:] == ["ep"]:
        kwargs["enable_expert_parallel"] = True
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=128, seed=0, **kwargs)
    inputs = [{"prompt_token_ids": ids} for ids in prompts["prompts"]]
    scored = llm.generate(inputs, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    logprobs = [[entry[tok].logprob for tok, entry in zip(ids[1:], r.prompt_logprobs[1:])]
                for ids, r in zip(prompts["prompts"], scored)]
    greedy = llm.generate(inputs, SamplingParams(max_tokens=prompts["max_new_tokens"], temperature=0.0,
                                                 ignore_eos=True))
    workers = llm.collective_rpc(plugin_state)
    with open(out, "w") as f:
        json.dump({"logprobs": logprobs, "greedy": [list(r.outputs[0].token_ids) for r in greedy],
                   "workers": workers, "main_pid": os.getpid()}, f)


if __name__ == "__main__":
    main()
