"""The README's Lightning snippet, run as written, for tests/integrations/test_lightning_readme.py.

python lightning_readme_child.py README DIR EPOCHS -> prints JSON on its last line

The snippet is taken from the README's "## Lightning" section and executed verbatim (its own
imports included) with ``model`` a small LightningModule that logs ``val_loss``, and one
change to ``lightning.pytorch.Trainer`` while it runs: defaults that keep the run short and
quiet (epochs, CPU, no logger, DIR as its root). Every argument the snippet passes reaches
Lightning unchanged.
"""

import functools
import json
import os
import re
import sys

import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class LitModel(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def _data(self, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)

    def train_dataloader(self):
        return self._data(0)

    def val_dataloader(self):
        return self._data(1)


class FirstStep(Callback):
    """The global step a fit starts from: 0 for a fresh run, the checkpoint's on resume."""
    step = None

    def on_train_start(self, trainer, pl_module):
        FirstStep.step = trainer.global_step


def snippet(readme: str) -> str:
    text = open(readme).read()
    section = text[text.index("\n## Lightning\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def main():
    readme, root, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pl.seed_everything(0)
    trainer_cls = functools.partial(pl.Trainer, max_epochs=epochs, accelerator="cpu", logger=False,
                                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                                    num_sanity_val_steps=0, deterministic=True)

    def make_trainer(*args, callbacks=(), **kwargs):
        return trainer_cls(*args, callbacks=[*callbacks, FirstStep()], **kwargs)

    ns = {"model": LitModel()}
    real = pl.Trainer
    pl.Trainer = make_trainer  # what the snippet's own "import lightning.pytorch as L" gets
    try:
        exec(compile(snippet(readme), "README.md (Lightning)", "exec"), ns)
    finally:
        pl.Trainer = real
    trainer, model = ns["trainer"], ns["model"]
    ckpt_cb = trainer.checkpoint_callback
    out = {"start_step": FirstStep.step, "global_step": trainer.global_step,
           "files": sorted(os.listdir(os.path.join(root, "checkpoints"))),
           "best_k": sorted(os.path.basename(p) for p in ckpt_cb.best_k_models),
           "monitor": ckpt_cb.monitor}
    last = os.path.join(root, "checkpoints", "last.ckpt")
    try:
        LitModel.load_from_checkpoint(last)
        out["lightning_load"] = "ok"
    except IsADirectoryError:
        out["lightning_load"] = "IsADirectoryError"
    from flashwrite.integrations.lightning import load_from_checkpoint
    again = load_from_checkpoint(LitModel, last, lr=0.5)
    out["helper_same_weights"] = all(torch.equal(a, b) for a, b in
                                     zip(again.state_dict().values(), model.state_dict().values()))
    out["helper_hparams"] = dict(again.hparams)
    val = trainer.validate(model, ckpt_path=last, verbose=False)
    out["validate_val_loss"] = val[0]["val_loss"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
