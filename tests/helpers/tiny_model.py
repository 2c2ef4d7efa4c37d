"""A tiny checkpoint folder (config + word-level tokenizer) built offline.

Words ``w0 .. w{n-1}`` map to ids ``4 .. 4+n-1`` after the specials
<unk>=0, <s>=1, </s>=2, <pad>=3, so with the counting executor the prompt
"w5" continues "w6 w7 w8 ...". The chat roles "system", "user" and
"assistant" come after the words.
"""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system", "user", "assistant")


def word(token_id: int) -> str:
    return f"w{token_id - 4}"


def make_tiny_model_dir(
    path: Path,
    num_words: int = 60,
    max_position_embeddings: int = 256,
    eos_token_id: int = 2,
    generation_config: dict | None = None,
    with_tokenizer: bool = True,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = 4 + num_words + len(ROLES)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": 1,
        "eos_token_id": eos_token_id,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(
        json.dumps(
            generation_config if generation_config is not None else {"eos_token_id": eos_token_id}
        )
    )
    if with_tokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
        vocab.update({f"w{i}": 4 + i for i in range(num_words)})
        vocab.update({role: 4 + num_words + i for i, role in enumerate(ROLES)})
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
        )
        fast.chat_template = (
            "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}"
        )
        fast.save_pretrained(str(path))
    return path
