"""Lightning runs for tests/integrations/test_lightning.py, in a fresh process (Lightning's DDP launcher
re-runs this script once per rank).

python lightning_child.py IO DIR DEVICES [NAMESPACE]  -> fit 5 steps (ModelCheckpoint every step, top 2 + last),
                                             resume from "last" to 10 steps, validate from a path;
                                             prints the final weights' bits as JSON on global rank 0.
IO is "flashwrite" or "torch" (Lightning's default TorchCheckpointIO).
"""

import json
import os
import sys

import torch

# NAMESPACE (optional 4th argument): "lightning.pytorch" (the default) or "pytorch_lightning",
# the Trainer the plug-in must work with (both may be installed at once).
if len(sys.argv) > 4 and sys.argv[4] == "pytorch_lightning":
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
else:
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import ModelCheckpoint
    except ImportError:
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import ModelCheckpoint

from flashwrite.integrations.lightning import FlashwriteCheckpointIO


class Net(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05, tag: str = "x"):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))


def trainer(io, dirpath, devices, steps):
    plugins = [FlashwriteCheckpointIO()] if io == "flashwrite" else []
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                           save_last=True)
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=devices,
                      strategy="ddp" if devices > 1 else "auto", plugins=plugins, callbacks=[ckpt], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                      num_sanity_val_steps=0, limit_val_batches=2)


def main():
    io, dirpath, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert pl.Trainer.__module__.startswith(sys.argv[4] if len(sys.argv) > 4 else pl.__name__)
    pl.seed_everything(7, workers=True)
    t1 = trainer(io, dirpath, devices, 5)
    t1.fit(Net(tag="run"), data())
    pl.seed_everything(123)  # the resumed run must take its state from the checkpoint, not the seed
    t2 = trainer(io, dirpath, devices, 10)
    model = Net(hidden=16, tag="other")
    t2.fit(model, data(), ckpt_path="last")
    mid = os.path.join(dirpath, next(n for n in sorted(os.listdir(dirpath)) if n.endswith("-step=9.ckpt")))
    val = t2.validate(model, data(), ckpt_path=mid, verbose=False)
    if t2.is_global_zero:
        print(json.dumps({
            "final": {k: v.reshape(-1).view(torch.int32).tolist() for k, v in model.state_dict().items()},
            "hparams": dict(model.hparams), "val": val[0]["val_loss"], "global_step": t2.global_step,
            "files": sorted(os.listdir(dirpath))}))


if __name__ == "__main__":
    main()
