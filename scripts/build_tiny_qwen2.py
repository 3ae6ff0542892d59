"""Build the tiny random Qwen2 model and its BPE tokenizer that the engine tiers serve (nothing is downloaded).

    python scripts/build_tiny_qwen2.py OUT_DIR [SEED]

Run with an engine venv's python (it needs torch, tokenizers and transformers). Hidden 128, 2 layers,
2 heads / 1 kv head, head_dim 64 (CPU attention needs >= 32), a BPE vocab trained here, 4096 positions
(long enough for a test request to decode for seconds, so it can be paused mid-flight), bf16. The same
recipe for both engine tiers (install-vllm-cpu.sh, install-sglang-cpu.sh).
"""

import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

RECIPE = "2: qwen2 h128 l2 a2/1 d64 vocab-bpe512 pos4096 seed0"


def build(out: str, seed: int) -> None:
    os.makedirs(out, exist_ok=True)
    corpus = ["The quick brown fox jumps over the lazy dog.",
              "Hello world! This is a tiny tokenizer for testing vLLM on CPU.",
              "Reinforcement learning with colocated trainer and inference engines.",
              "0 1 2 3 4 5 6 7 8 9 10 100 1000"] * 50
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf_tok.save_pretrained(out)
    eos = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=len(hf_tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "colocd-recipe"), "w") as f:
        f.write(RECIPE + "\n")


if __name__ == "__main__":
    build(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
