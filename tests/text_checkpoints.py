"""A tiny random Llama with a word-level tokenizer, written into a directory for the tests that
need a local Hugging Face checkpoint with text (generate, serve). Nothing downloads."""

from __future__ import annotations

import torch


def write_text_checkpoint(
    path,
    words: list[str],
    *,
    num_layers: int,
    max_positions: int,
    tokenizer: bool = True,
    chat_template: str | None = None,
) -> None:
    """A Llama of ``len(words)`` tokens (token ``i`` is ``words[i]``; the first four are
    ``<pad> <s> </s> <unk>``), weights larger than the default init so greedy tokens vary."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tokenizer:
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
        )
        if chat_template is not None:
            fast.chat_template = chat_template
        fast.save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=len(words),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init: varied greedy tokens
            p.normal_(0, 0.3) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)
