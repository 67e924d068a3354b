"""A tiny random BertModel (all-MiniLM-L6-v2's shape, smaller) saved as a real folder, built offline: safetensors
weights as transformers saves them, and a WordPiece tokenizer made with ``tokenizers`` from a small vocabulary
(tokenizer.json + tokenizer_config.json, which AutoTokenizer loads; [CLS] ... [SEP] added around one text)."""
from __future__ import annotations

import json
import string
from pathlib import Path

import torch

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "ship", "ships", "light", "house", "keeper", "fog", "harbour", "over", "at", "dawn", "##s",
         "##ing", "##ed"]
MAX_POSITIONS = 128


def vocabulary() -> dict[str, int]:
    """Special tokens first (BERT's ids 0..4), then whole letters and digits, their ## continuations, punctuation
    and a few words: any lowercase ASCII text tokenizes without [UNK]."""
    pieces = list(string.ascii_lowercase + string.digits)
    tokens = SPECIAL + pieces + ["##" + p for p in pieces] + list(string.punctuation) + WORDS
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = vocabulary()
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                            pad_token="[PAD]", mask_token="[MASK]").save_pretrained(folder)


def save_vocab_txt_tokenizer(folder: Path) -> None:
    """The same vocabulary as an older BERT checkpoint ships it: vocab.txt and a BertTokenizer config only."""
    vocab = vocabulary()
    (folder / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                              "do_lower_case": True}))


def save_tiny_bert(folder: Path) -> None:
    """hidden 64, 2 layers, 4 heads, intermediate 128. Every parameter is perturbed off its initial value (the
    LayerNorms' ones and zeros, the unused token type 1 included), so a weight loaded into the wrong place shows."""
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=len(vocabulary()), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=MAX_POSITIONS)
    torch.manual_seed(0)
    model = BertModel(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)


def add_sentence_transformers_modules(folder: Path, pooling: str) -> None:
    """sentence-transformers' files beside the model (modules.json: Transformer, Pooling, Normalize), the Pooling
    module's config declaring ``pooling`` (CLS, MEAN or LAST) as all-MiniLM-L6-v2's declares MEAN."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "2_Normalize").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "CLS",
        "pooling_mode_mean_tokens": pooling == "MEAN", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": pooling == "LAST"}))
