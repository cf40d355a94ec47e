"""A tiny causal LM trained by the Trainer, for tests/integrations/test_transformers.py (run as a child:
each run, and each resume, in a fresh process).

argv: mode ("flashwrite" or "trainer"), output_dir, max_steps, save_steps, resume ("0"/"1"), result.json
Writes every micro-batch loss as its float32 bit pattern, in order, to result.json.
"""

import json
import sys

import torch
import transformers

from flashwrite.integrations.transformers import FlashwriteTrainer


def tiny_model():
    torch.manual_seed(0)
    # Dropout on: a resume that does not restore the RNG states gives other losses.
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


class Plain(torch.nn.Module):
    """A model that is not a PreTrainedModel (no config, no _keys_to_ignore_on_save)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.out = torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1)), "logits": logits}


def tiny_data(n=16):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (n, 12), generator=g)]


def tiny_args(output_dir, **kw):
    base = dict(per_device_train_batch_size=2, learning_rate=1e-2, warmup_steps=2, report_to=[], use_cpu=True,
                disable_tqdm=True, logging_steps=1, seed=42, dataloader_num_workers=0)
    base.update(kw)
    return transformers.TrainingArguments(output_dir, **base)


def recording(cls):
    class Recording(cls):
        losses: list

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            value = (loss[0] if isinstance(loss, tuple) else loss).detach().float().reshape(1)
            self.losses.append(int(value.view(torch.int32).item()))
            return loss

    return Recording


def main():
    mode, out, max_steps, save_steps, resume, result = sys.argv[1:7]
    cls = recording(FlashwriteTrainer if mode == "flashwrite" else transformers.Trainer)
    trainer = cls(model=tiny_model(), args=tiny_args(out, max_steps=int(max_steps), save_steps=int(save_steps)),
                  train_dataset=tiny_data())
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume == "1")
    with open(result, "w") as fh:
        json.dump({"losses": trainer.losses}, fh)


if __name__ == "__main__":
    main()
