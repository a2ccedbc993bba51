"""Build a small random-weight causal LM and a BPE tokenizer trained on the bundled text.

No model hub is needed: the result is saved as an ordinary Hugging Face model directory and loaded by
path, through the same code a hub id would take.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from optuna_rapidfire.demo._data import _read_rows

if TYPE_CHECKING:
    import os

_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.2,
    seed: int = 0,
) -> Path:
    """Create a Llama-architecture model with random weights and its tokenizer under ``path``.

    The tokenizer is a byte-level BPE trained on the bundled GSM8K text; the model has the usual
    ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and MLP projections, so LoRA configs written for real
    Llama models apply unchanged. An existing complete model directory at ``path`` is reused.

    Args:
        path: Directory to write (created if needed).
        hidden_size: Width of the model.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Number of attention heads (``hidden_size`` must divide evenly).
        intermediate_size: MLP width; ``4 * hidden_size`` by default.
        vocab_size: Size of the BPE vocabulary.
        max_position_embeddings: Longest sequence the model accepts.
        initializer_range: Standard deviation of the random weights. Larger than a real model's 0.02,
            so a tiny model's logits are not all alike and LoRA can visibly lower the loss.
        seed: Seed of the random weights.

    Returns:
        ``path`` as a :class:`pathlib.Path`, ready for ``RapidFireExecutor(model=path)`` or
        ``AutoModelForCausalLM.from_pretrained(path)``.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    if hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size must be a multiple of num_attention_heads, but got {hidden_size=} and {num_attention_heads=}."
        )
    out = Path(path)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [row["question"] + "\n" + row["answer"] for row in _read_rows("train")[:2000]]
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.model_max_length = max_position_embeddings
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for writing one small file is noise in the demo and examples
    try:
        model.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    return out
