"""Hugging Face Trainer: ``dist.init_process_group("loco")`` before ``TrainingArguments`` (the
Trainer's accelerate state then uses that group; ``ddp_backend="loco"`` is refused); metrics
added in ``Trainer.log``, the method HF documents for custom logging, so that every reporting
integration (TensorBoard, wandb) gets them, summed over the steps since the last log.
``python hf_recipe.py BACKEND OUTPUT_DIR`` under torchrun."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

import lowbitcc
from tests.clients.recipes.common import dataset, model, report

dist.init_process_group(sys.argv[1])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"x": x, "labels": y}


class LocoTrainer(Trainer):
    """A Trainer whose logs carry lowbitcc's metrics since the previous log."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loco = lowbitcc.StepMetrics()

    def log(self, logs, *args, **kwargs) -> None:
        super().log({**logs, **self.loco.collect()}, *args, **kwargs)


args = TrainingArguments(output_dir=sys.argv[2], per_device_train_batch_size=16,
                         num_train_epochs=1, learning_rate=0.05, optim="sgd",
                         lr_scheduler_type="constant", logging_steps=4, report_to=[],
                         save_strategy="no", use_cpu=True)
trainer = LocoTrainer(model=Net(), args=args, train_dataset=Rows())
out = trainer.train()
if dist.get_rank() == 0:
    report(dist.get_backend(), out.training_loss,
           [k for k in trainer.state.log_history[0] if k.startswith("loco/")])
