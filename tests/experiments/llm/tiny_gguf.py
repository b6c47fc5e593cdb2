"""A tiny Llama written as a GGUF file (float32 tensors, a byte-level BPE tokenizer of 30 tokens), as
SmolLM2's package ships its model: for the tests of ``load_smollm2``'s conversion cache (not a test module).
Needs the ``gguf`` package (the ``llm`` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TOKENS = ["<|endoftext|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġt", "th", "the"]
MERGES = ["Ġ t", "t h", "th e"]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    d, ff, layers, heads, kv_heads = 32, 48, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(d // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_merges(MERGES)
    w.add_token_types([3] + [1] * (len(TOKENS) - 1))
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", len(TOKENS), d)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", d)
        tensor(f"blk.{i}.ffn_norm.weight", d)
        tensor(f"blk.{i}.attn_q.weight", d, d)
        tensor(f"blk.{i}.attn_k.weight", d * kv_heads // heads, d)
        tensor(f"blk.{i}.attn_v.weight", d * kv_heads // heads, d)
        tensor(f"blk.{i}.attn_output.weight", d, d)
        tensor(f"blk.{i}.ffn_gate.weight", ff, d)
        tensor(f"blk.{i}.ffn_up.weight", ff, d)
        tensor(f"blk.{i}.ffn_down.weight", d, ff)
    tensor("output_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
