"""A transformers maintainer's reproduction of the zoo's silent TP bugs, with nothing but torch and
transformers: a tiny model saved, loaded with ``from_pretrained(distributed_config=DistributedConfig(
tp_plan="auto"))`` on 2 ranks, one
forward and backward on the same tokens as one process; prints every parameter whose gradient
differs, and whether its ranks' gradients summed match (a missing all-reduce).

    torchrun --nproc-per-node 2 docs/zoo_repro.py apertus
    torchrun --nproc-per-node 2 docs/zoo_repro.py qwen3_vl_moe_text
    torchrun --nproc-per-node 2 docs/zoo_repro.py llama            # a right plan: prints nothing wrong
"""
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DistributedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def main(model_type: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    auto = AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel
    fields = AutoConfig.for_model(model_type).to_dict()
    config = AutoConfig.for_model(model_type, **{k: v for k, v in SIZES.items() if k in fields})
    torch.manual_seed(0)
    one = auto.from_config(config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float64)
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    if dist.get_rank() == 0:
        one.save_pretrained(path[0])
    dist.barrier()
    parallel = auto.from_pretrained(path[0], distributed_config=DistributedConfig(tp_plan="auto"),
                                    attn_implementation="eager", experts_implementation="eager", dtype=torch.float64)
    for model in (one, parallel):
        out = model(input_ids=tokens)
        value = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        value.float().pow(2).mean().backward()
    wrong = []
    for (name, want), (_, got) in zip(one.named_parameters(), parallel.named_parameters()):
        grad = got.grad.full_tensor() if hasattr(got.grad, "full_tensor") else got.grad
        if not torch.allclose(grad, want.grad, rtol=1e-9, atol=1e-12):
            summed = grad.clone()
            dist.all_reduce(summed)
            wrong.append(f"{name}: gradient differs" + ("; summed over the ranks it matches: its all-reduce is "
                                                        "missing" if torch.allclose(summed, want.grad) else ""))
    if dist.get_rank() == 0:
        print("\n".join(wrong) or f"{model_type}: every parameter's gradient matches one process")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
