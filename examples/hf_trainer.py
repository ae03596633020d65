"""Fine-tune a tiny, randomly initialised BERT with Hugging Face's Trainer (no download).

    python -m ort_autopatch --log-level INFO \\
        --modules 'transformers.models.bert.modeling_bert:BertForSequenceClassification' \\
        examples/hf_trainer.py

The selected class is found by the import hook when transformers loads it; Trainer's own loop
(`model(**batch)`, loss.backward(), AdamW) is untouched. A few steps on random tokens, on CPU.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, length), generator=generator)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


def main() -> None:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        attn_implementation="eager",
    )
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=6,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            logging_steps=2,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(64, 16, 128))
        result = trainer.train()
    print(f"trained {result.global_step} steps, final loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
