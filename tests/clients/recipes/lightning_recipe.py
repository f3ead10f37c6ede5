"""Lightning: ``DDPStrategy(process_group_backend="loco")``, or FSDP2 with
``ModelParallelStrategy(process_group_backend="loco")`` and ``fully_shard`` in
``configure_model`` (Lightning's ``FSDPStrategy``, FSDP1, refuses CPU accelerators); metrics with
``self.log_dict(lowbitcc.StepMetrics().collect())``. ``python lightning_recipe.py BACKEND
ddp|fsdp2`` under torchrun."""

import sys

import lightning
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

import lowbitcc
from tests.clients.recipes.common import dataset, model, report

backend, kind = sys.argv[1], sys.argv[2]


class Module(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()
        self.loco = lowbitcc.StepMetrics()

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_model(self) -> None:
        if kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def on_train_batch_end(self, *args) -> None:
        self.log_dict(self.loco.collect())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


strategy = (DDPStrategy(process_group_backend=backend) if kind == "ddp"
            else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                       process_group_backend=backend))
trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Module(), torch.utils.data.DataLoader(dataset(), batch_size=16))
if trainer.global_rank == 0:
    metrics = trainer.callback_metrics
    report(torch.distributed.get_backend(), float(metrics["loss"]),
           [k for k in metrics if k.startswith("loco/")])
