"""Lightning runs in a fresh process for tests/integrations/test_lightning_contract.py.

python lightning_contract_child.py spawn DIR  -> fit 2 steps under strategy="ddp_spawn" on 2 CPU ranks (gloo)
                                                with FlashwriteCheckpointIO, a checkpoint every step
python lightning_contract_child.py save DIR   -> fit 2 steps on one process: a Net, a DataModule with
                                                hyper-parameters and a Hydra-style Net (DictConfig)
python lightning_contract_child.py load DIR   -> a new process: load those with
                                                flashwrite.lightning.load_from_checkpoint
Each prints one JSON line last.
"""

import hashlib
import json
import os
import sys

import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from flashwrite.integrations.lightning import FlashwriteCheckpointIO, load_from_checkpoint


class Net(pl.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(8, hidden)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class HydraNet(pl.LightningModule):
    """The Hydra pattern: the module takes the config (a DictConfig) and saves it as its hyper-parameters."""

    def __init__(self, cfg):  # an OmegaConf DictConfig
        super().__init__()
        self.save_hyperparameters(cfg)
        self.net = torch.nn.Linear(8, cfg.model.hidden)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 8, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(self.hparams.seed))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=self.hparams.batch_size)


def trainer(dirpath, **kwargs):
    return pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[FlashwriteCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1,
                                                 monitor="step", mode="max")], **kwargs)


def digest(module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


CFG = {"model": {"hidden": 6}, "lr": 0.05, "name": "h${model.hidden}", "layers": [1, 2]}


def main():
    mode, where = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    pl.seed_everything(0)
    out: dict = {}
    if mode == "spawn":
        t = trainer(where, devices=2, strategy="ddp_spawn")
        t.fit(Net(), Data())
        out = {"files": sorted(os.listdir(where))}
    elif mode == "save":
        net, data = Net(hidden=5, lr=0.2), Data(batch_size=4, seed=3)
        trainer(os.path.join(where, "net")).fit(net, data)
        from omegaconf import OmegaConf
        hydra = HydraNet(OmegaConf.create(CFG))
        trainer(os.path.join(where, "hydra")).fit(hydra, Data())
        out = {"net": digest(net), "hydra": digest(hydra)}
    elif mode == "load":
        from omegaconf import OmegaConf
        net = load_from_checkpoint(Net, os.path.join(where, "net", "epoch=0-step=2.ckpt"))
        data = load_from_checkpoint(Data, os.path.join(where, "net", "epoch=0-step=2.ckpt"))
        hydra = load_from_checkpoint(HydraNet, os.path.join(where, "hydra", "epoch=0-step=2.ckpt"))
        out = {"net": digest(net), "net_hparams": dict(net.hparams), "data_hparams": dict(data.hparams),
               "hydra": digest(hydra), "hydra_type": type(hydra.hparams).__name__,
               "hydra_name": hydra.hparams.name, "hydra_hparams": OmegaConf.to_container(hydra.hparams)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
