"""The zoo's model table: tiny randomly initialised models users fine-tune, and the batches
each is trained on.

Batches vary the pattern, not only the model (zoo.md's lesson): text models see right padding,
left padding, pad tokens inside the content, no attention_mask and a second shape, one per
step; decoders keep transformers' default `use_cache=True`, so a DynamicCache is among their
outputs. Dropout is 0 everywhere: ORT's masks are not eager's bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 97
PAD = 0

Batch = dict[str, Any]


@dataclass(frozen=True)
class Entry:
    """One zoo model: how to build it and the batch of each training step."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Batch]
    loss: Callable[[Any, Batch], torch.Tensor] = field(default=lambda out, batch: out.loss)
    fast: bool = False  # part of the default test run
    #: None: must run in ORT with eager's numbers. Otherwise the fallback reason expected.
    expect_fallback: str | None = None


# -- batches ----------------------------------------------------------------------------------

#: (padding pattern, batch, sequence length) of each step: the first four share a shape.
TEXT_STEPS = [("right", 2, 8), ("left", 2, 8), ("inside", 2, 8), ("none", 2, 8), ("right", 3, 12)]


def text_batch(
    step: int, gen: torch.Generator, *, labels: str = "ids", mask_always: bool = False
) -> Batch:
    """Token ids and a mask in TEXT_STEPS' pattern for `step`; labels ignore padded places.

    "inside" puts the pad id in the content where the loss sees it (nn.Embedding's padding_idx
    row must keep a zero gradient) and masks a hole in the middle of the second row.
    """
    pattern, batch, length = TEXT_STEPS[step % len(TEXT_STEPS)]
    ids = torch.randint(1, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pattern == "right":
        mask[0, length - 3 :] = 0
    elif pattern == "left":
        mask[0, :3] = 0
    elif pattern == "inside":
        ids[:, 2] = PAD
        mask[1, 3:5] = 0
    ids = ids.masked_fill(mask == 0, PAD) if pattern != "inside" else ids
    out: Batch = {"input_ids": ids}
    if pattern != "none" or mask_always:
        out["attention_mask"] = mask
    if labels == "ids":
        out["labels"] = ids.masked_fill(mask == 0, -100)
    elif labels == "class":
        out["labels"] = torch.randint(0, 3, (batch,), generator=gen)
    return out


def seq2seq_batch(step: int, gen: torch.Generator) -> Batch:
    """Encoder text in TEXT_STEPS' pattern, decoder labels of another length."""
    batch = text_batch(step, gen, labels="none")
    rows = batch["input_ids"].shape[0]
    batch["labels"] = torch.randint(1, VOCAB, (rows, 5 + step % 2), generator=gen)
    return batch


def image_batch(step: int, gen: torch.Generator, size: int = 32, classes: int = 3) -> Batch:
    rows = 2 if step < 4 else 3
    return {
        "pixel_values": torch.randn(rows, 3, size, size, generator=gen),
        "labels": torch.randint(0, classes, (rows,), generator=gen),
    }


# -- transformers models ------------------------------------------------------------------------


def _hf(name: str, config: str, attn: str = "sdpa", **kwargs: Any) -> Callable[[], nn.Module]:
    """A transformers model from its config class, with SDPA attention where transformers
    offers it (its default; the eager reference runs it on the kernel torch picks)."""

    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config)(**kwargs)
        cfg._attn_implementation = attn
        return getattr(transformers, name)(cfg)

    return build


def _checkpointed(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def with_checkpointing() -> nn.Module:
        model: Any = build()
        model.gradient_checkpointing_enable()  # transformers' default: reentrant
        return model

    return with_checkpointing


_ENC: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "pad_token_id": PAD,
}
_DEC: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "pad_token_id": PAD,
}

_gpt2 = _hf(
    "GPT2LMHeadModel",
    "GPT2Config",
    vocab_size=VOCAB,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=64,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
_bert = _hf("BertForMaskedLM", "BertConfig", **_ENC)
_llama = _hf("LlamaForCausalLM", "LlamaConfig", **_DEC)

ENTRIES: list[Entry] = [
    Entry("bert", _bert, text_batch, fast=True),
    Entry(
        "roberta",
        _hf("RobertaForMaskedLM", "RobertaConfig", **{**_ENC, "pad_token_id": 1}),
        text_batch,
    ),
    Entry(
        "distilbert",
        _hf(
            "DistilBertForMaskedLM",
            "DistilBertConfig",
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=PAD,
        ),
        text_batch,
    ),
    Entry(
        "albert",
        _hf("AlbertForMaskedLM", "AlbertConfig", **{**_ENC, "embedding_size": 16}),
        text_batch,
    ),
    Entry(
        "electra",
        _hf("ElectraForMaskedLM", "ElectraConfig", "eager", **{**_ENC, "embedding_size": 16}),
        text_batch,
    ),
    Entry("gpt2", _gpt2, text_batch, fast=True),
    Entry(
        "gpt-neo",
        _hf(
            "GPTNeoForCausalLM",
            "GPTNeoConfig",
            "eager",
            vocab_size=VOCAB,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
            embed_dropout=0.0,
            attention_dropout=0.0,
            resid_dropout=0.0,
            pad_token_id=PAD,
        ),
        text_batch,
    ),
    Entry(
        "opt",
        _hf(
            "OPTForCausalLM",
            "OPTConfig",
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=1,
        ),
        text_batch,
    ),
    Entry("llama", _llama, text_batch, fast=True),
    Entry(
        "mistral",
        _hf("MistralForCausalLM", "MistralConfig", **{**_DEC, "sliding_window": 4}),
        text_batch,
        fast=True,
    ),
    Entry("qwen2", _hf("Qwen2ForCausalLM", "Qwen2Config", **_DEC), text_batch),
    Entry(
        "t5",
        _hf(
            "T5ForConditionalGeneration",
            "T5Config",
            "eager",
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            pad_token_id=PAD,
            decoder_start_token_id=PAD,
        ),
        seq2seq_batch,
    ),
    Entry(
        "bart",
        _hf(
            "BartForConditionalGeneration",
            "BartConfig",
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=1,
            decoder_start_token_id=2,
        ),
        seq2seq_batch,
    ),
    Entry(
        "vit",
        _hf(
            "ViTForImageClassification",
            "ViTConfig",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        image_batch,
    ),
    Entry(
        "whisper-encoder",
        _hf(
            "WhisperForAudioClassification",
            "WhisperConfig",
            vocab_size=VOCAB,
            num_mel_bins=8,
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=4,
            decoder_layers=1,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=16,
            num_labels=3,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        lambda step, gen: {
            "input_features": torch.randn(2 if step < 4 else 3, 8, 32, generator=gen),
            "labels": torch.randint(0, 3, (2 if step < 4 else 3,), generator=gen),
        },
    ),
    Entry("gpt2+checkpointing", _checkpointed(_gpt2), text_batch, fast=True),
    Entry("bert+checkpointing", _checkpointed(_bert), text_batch),
    Entry("llama+checkpointing", _checkpointed(_llama), text_batch),
]


# -- models written here ------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    """ResNet-style CNN: stem with max pooling, residual blocks with BatchNorm, global pool."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.blocks = nn.Sequential(_Block(8, 8, 1), _Block(8, 16, 2))
        self.head = nn.Linear(16, classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.blocks(self.stem(pixel_values))
        logits = self.head(x.mean(dim=(2, 3)))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class UNet(nn.Module):
    """U-Net-style model: two downsampling levels, transposed-conv and interpolated upsampling,
    skip connections by concatenation, GroupNorm, a per-pixel regression loss."""

    def __init__(self) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU()
            )

        self.down1, self.down2 = conv(3, 8), conv(8, 16)
        self.middle = conv(16, 16)
        self.up2 = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.dec2 = conv(32, 8)
        self.dec1 = conv(16, 8)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        d1 = self.down1(pixel_values)
        d2 = self.down2(nn.functional.avg_pool2d(d1, 2))
        m = self.middle(nn.functional.avg_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
        u1 = nn.functional.interpolate(u2, scale_factor=2.0, mode="nearest")
        u1 = self.dec1(torch.cat([u1, d1], dim=1))
        pred = self.out(u1)
        return {"loss": nn.functional.mse_loss(pred, labels), "pred": pred}


def _unet_batch(step: int, gen: torch.Generator) -> Batch:
    size = 32 if step < 4 else 48
    rows = 2
    return {
        "pixel_values": torch.randn(rows, 3, size, size, generator=gen),
        "labels": torch.randn(rows, 3, size, size, generator=gen),
    }


def _resnet_batch(step: int, gen: torch.Generator) -> Batch:
    return image_batch(step, gen, size=16 if step < 4 else 24)


ENTRIES += [
    Entry("resnet", ResNet, _resnet_batch, lambda out, batch: out["loss"], fast=True),
    # GroupNorm exports as InstanceNormalization, which has no gradient in ORT 1.19.2, and the
    # CPU build has no ConvTransposeGrad or ResizeGrad kernel (the CUDA build has both): those
    # operators run as torch-calling nodes inside the graph.
    Entry("unet", UNet, _unet_batch, lambda out, batch: out["loss"]),
]

BY_NAME = {entry.name: entry for entry in ENTRIES}
FAST = [entry.name for entry in ENTRIES if entry.fast]
